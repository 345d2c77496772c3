"`python -m accum_finetune`: the `accum-finetune` command (also `python -m accum_callback`)"
from .cli import run

if __name__ == '__main__': run('python -m accum_finetune')
