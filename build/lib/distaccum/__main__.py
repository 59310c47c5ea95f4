"""``python -m distaccum`` is the ``distaccum`` console script."""

from distaccum.cli import main

if __name__ == "__main__":
    main()
