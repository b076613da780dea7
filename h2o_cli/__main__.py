"""`python -m h2o_cli ...` (and `accelerate launch -m h2o_cli ...`): the `h2o` command."""

from h2o_cli.cli.app import main

if __name__ == "__main__":
    main()
