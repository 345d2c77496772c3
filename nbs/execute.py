"""Run the notebooks and store their outputs in place, at the settings the test suite runs them with (no ACCUM_*_FULL
flag), so that what a reader sees on GitHub is what the code produces; the suite re-runs them and fails on stale outputs.

    python nbs/execute.py                       # every notebook in nbs/
    python nbs/execute.py nbs/01_quickstart.ipynb"""
import os, sys, tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NBS = Path(__file__).resolve().parent

def execute(path:Path, timeout:int=900)->nbformat.NotebookNode:
    "Run `path` in a fresh kernel in a temporary folder, as the tests do; return the notebook with its outputs"
    nb = nbformat.read(path, as_version=4)
    nbformat.validator.normalize(nb)   # cell ids
    env = {k: v for k,v in os.environ.items() if not k.startswith('ACCUM_') or k == 'ACCUM_CALLBACK_CACHE'}
    with tempfile.TemporaryDirectory() as d:
        old = dict(os.environ); os.environ.clear(); os.environ.update(env)
        try: NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': d}}).execute()
        finally: os.environ.clear(); os.environ.update(old)
    for c in nb.cells:
        c.metadata.pop('execution', None)   # timings: noise in every diff
    return nb

if __name__ == '__main__':
    for p in [Path(a) for a in sys.argv[1:]] or sorted(NBS.glob('*.ipynb')):
        nbformat.write(execute(p), p)
        print('executed', p)
