"""``python -m pagoda_operator.router``: the router's command line (``cli.main``)."""

from pagoda_operator.router.cli import main

if __name__ == "__main__":
    main()
