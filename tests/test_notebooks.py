"""The notebooks in nbs/ are part of the product: they are stored with their outputs (so that they read without running),
and each test re-executes one (small settings: no ACCUM_*_FULL flag) in a temporary folder and checks that
- every code cell that has an output in the stored copy still produces an output of the same kind (text, image): a
  notebook whose stored outputs no longer come from its code fails;
- nothing warns: no stderr output, no nbformat warning (cell ids), no missing-widget warning;
- every figure shows data: an axes with no line with points, bar, image or marker fails (`nbs/execute.py`'s check, run
  first in the kernel, reports it on stderr);
- the stored copy has outputs on at least 80% of its code cells and at least one plot.
`python nbs/execute.py` re-runs them and stores the outputs."""
import warnings
from pathlib import Path

import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

NBS = sorted((Path(__file__).resolve().parents[1]/'nbs').glob('*.ipynb'))

def _execute_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location('nbs_execute', Path(__file__).resolve().parents[1]/'nbs'/'execute.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def kinds(cell)->set:
    "What a code cell showed: 'text' (streams, text/plain/html/markdown results) and 'image' (a PNG)"
    out = set()
    for o in cell.get('outputs', []):
        if o.output_type == 'stream': out.add('text')
        elif o.output_type == 'error': out.add('error')
        else:
            d = o.get('data', {})
            if 'image/png' in d: out.add('image')
            if {'text/plain', 'text/html', 'text/markdown'} & set(d) and 'image/png' not in d: out.add('text')
    return out

def stderr(cell)->str: return ''.join(o.text for o in cell.get('outputs', []) if o.output_type == 'stream' and o.name == 'stderr')

def _stored(nb):
    "The stored notebook, read and validated (nbformat's warnings are errors)"
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # nbformat's MissingIDFieldWarning and the like
        stored = nbformat.read(nb, as_version=4)
        nbformat.validate(stored)
    return stored

@pytest.mark.parametrize('nb', NBS, ids=[p.name for p in NBS])
def test_stored_notebook_reads_with_outputs_plots_and_no_warning(nb):
    "What a reader sees without running it (the everyday tier: no kernel)"
    stored = _stored(nb)
    code = [c for c in stored.cells if c.cell_type == 'code']
    assert all(c.get('id') for c in stored.cells), 'every cell has an id'
    assert sum(bool(c.outputs) for c in code) >= 0.8*len(code), 'stored outputs on at least 80% of the code cells'
    assert any('image' in kinds(c) for c in code), 'at least one stored plot'
    assert not any(stderr(c) for c in code), 'the stored copy warns'
    assert not any('error' in kinds(c) for c in code), 'the stored copy holds an error'

@pytest.mark.parametrize('nb', NBS, ids=[p.name for p in NBS])
def test_notebook(nb, tmp_path, cache, monkeypatch):
    "Executed in a kernel (the full tier): the stored outputs still come from its code, and nothing warns"
    for flag in ('ACCUM_STUDY_FULL', 'ACCUM_NB_FULL'): monkeypatch.delenv(flag, raising=False)   # the small settings
    stored = _stored(nb)
    code = [c for c in stored.cells if c.cell_type == 'code']
    run = _execute_module().with_plot_check(stored)
    for c in run.cells:
        if c.cell_type == 'code': c.outputs = []
    nbclient.NotebookClient(run, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(tmp_path)}}).execute()
    assert not stderr(run.cells[0]), stderr(run.cells[0])
    for i,(a,b) in enumerate(zip(code, [c for c in run.cells[1:] if c.cell_type == 'code'])):
        assert not stderr(b), f'{nb.name} code cell {i} writes to stderr (a warning?):\n{stderr(b)[:500]}'
        assert kinds(a) <= kinds(b), f'{nb.name} code cell {i}: stored outputs {kinds(a)}, now {kinds(b)}: stale, run nbs/execute.py'
