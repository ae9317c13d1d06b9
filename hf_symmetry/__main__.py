"""``python -m hf_symmetry ...`` (and ``accelerate launch -m hf_symmetry heal ...``): the CLI."""

import sys

from .cli import main

sys.exit(main())
