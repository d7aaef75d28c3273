"""``python -m attnzoo``: the same command line as ``attnzoo``."""
import sys

from attnzoo.cli import main

if __name__ == "__main__":
    sys.exit(main())
