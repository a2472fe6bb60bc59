"""``python -m vramsweep.sweeper sweep=<name> [overrides]`` =
``vramsweep train -m sweep=<name> [overrides]``."""

from vramsweep.sweeper.multirun import main

if __name__ == "__main__":
    main()
