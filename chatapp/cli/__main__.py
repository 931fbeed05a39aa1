"""`python -m chatapp.cli ...`: the same as `python -m chatapp ...`."""

from chatapp.cli.table import main

if __name__ == "__main__":
    main()
