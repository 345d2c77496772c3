"""Run the notebooks and store their outputs in place, at the settings the test suite runs them with (no ACCUM_*_FULL
flag), so that what a reader sees on GitHub is what the code produces; the suite re-runs them and fails on stale outputs.

    python nbs/execute.py                       # every notebook in nbs/
    python nbs/execute.py nbs/01_quickstart.ipynb"""
import os, sys, tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NBS = Path(__file__).resolve().parent

# Run first (and removed from what is stored): every figure the notebook shows is checked as it is drawn, and an axes
# with nothing in it (no line with points, bar, image or marker) is reported on stderr, which fails the notebook test
PLOT_CHECK = """\
import sys as _sys, matplotlib.backend_bases as _bb
def _drawn(ax):
    return (any(len(l.get_xydata()) for l in ax.lines) or ax.patches or ax.images
            or any(len(c.get_offsets()) or len(c.get_paths()) for c in ax.collections))
_print_figure = _bb.FigureCanvasBase.print_figure
def _checked(self, *args, **kwargs):
    for ax in self.figure.axes:
        if ax.get_visible() and not _drawn(ax):
            print(f"empty plot: axes {ax.get_title() or ax.get_ylabel() or '(untitled)'!r} shows nothing", file=_sys.stderr)
    return _print_figure(self, *args, **kwargs)
_bb.FigureCanvasBase.print_figure = _checked
"""

def with_plot_check(nb:nbformat.NotebookNode)->nbformat.NotebookNode:
    "A copy of `nb` whose first cell is `PLOT_CHECK`"
    nb = nbformat.from_dict(nb)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PLOT_CHECK))
    return nb

def execute(path:Path, timeout:int=900)->nbformat.NotebookNode:
    "Run `path` in a fresh kernel in a temporary folder, as the tests do; return the notebook with its outputs"
    nb = with_plot_check(nbformat.read(path, as_version=4))
    nbformat.validator.normalize(nb)   # cell ids
    env = {k: v for k,v in os.environ.items() if not k.startswith('ACCUM_') or k == 'ACCUM_CALLBACK_CACHE'}
    with tempfile.TemporaryDirectory() as d:
        old = dict(os.environ); os.environ.clear(); os.environ.update(env)
        try: NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': d}}).execute()
        finally: os.environ.clear(); os.environ.update(old)
    check = nb.cells.pop(0)
    if any(o.get('name') == 'stderr' for o in check.outputs) or any(
            o.get('name') == 'stderr' and 'empty plot' in o.text for c in nb.cells for o in c.get('outputs', [])):
        raise RuntimeError(f"{path}: a figure shows nothing (see its cell's stderr)")
    for c in nb.cells:
        c.metadata.pop('execution', None)   # timings: noise in every diff
    return nb

if __name__ == '__main__':
    for p in [Path(a) for a in sys.argv[1:]] or sorted(NBS.glob('*.ipynb')):
        nbformat.write(execute(p), p)
        print('executed', p)
