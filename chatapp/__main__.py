"""`python -m chatapp ...` and the `chatapp` script both start here.

The CLI is imported inside `main`: the TUI's engine process (multiprocessing's spawn) runs the script again to
rebuild `__main__`, and importing the CLI there (Typer, Click, Rich: ~0.1 s) would delay the model's load."""


def main() -> None:
    from chatapp.cli import main as run

    run()


if __name__ == "__main__":
    main()
