"""``python -m attnzoo``: the same command line as ``attnzoo``."""
import sys

if __name__ == "__main__":
    try:  # importing the command line imports torch, which takes a while: Ctrl-C then is one line too
        from attnzoo.cli import main
    except KeyboardInterrupt:
        print("\nattnzoo: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
