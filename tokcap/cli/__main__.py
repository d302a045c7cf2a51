"""``python -m tokcap.cli`` runs the ``tokcap`` command, for environments without the console script."""

from tokcap.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
