"""``python -m disagg`` is ``disagg-node``."""

from disagg.cli.node import main

if __name__ == "__main__":
    main()
