"""`python -m poolloader [options] SCRIPT [ARGS...]`: see poolloader.adopt.runner."""
from poolloader.adopt.runner import main

if __name__ == "__main__":
    main()
