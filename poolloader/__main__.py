"""`python -m poolloader [options] SCRIPT [ARGS...]`: see poolloader.runner."""
from poolloader.runner import main

if __name__ == "__main__":
    main()
