"""`python -m chatapp ...`: the same as the `chatapp` console script."""

from chatapp.cli import main

main()
