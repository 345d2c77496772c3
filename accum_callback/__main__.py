"`python -m accum_callback`: the fine-tuning job `accum-finetune` (it lives in the `accum_finetune` package)"
from accum_finetune.cli import run

if __name__ == '__main__': run('python -m accum_callback')
