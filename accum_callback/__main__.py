"`python -m accum_callback`: the `accum-finetune` command"
import sys
from .cli import main

if __name__ == '__main__': sys.exit(main())
