"""Fixtures shared by the test modules, and the two tiers (`tiers.py`). None leaves anything behind: environment changes
last one test (monkeypatch).

    python -m pytest          the everyday tier: every test that runs in this process (minutes, every test file)
    python -m pytest --full   the full tier: those and every test that starts processes (gloo ranks, the job, torchrun,
                              notebook kernels, bench scripts), marked `processes` here by what they use"""
import contextlib, os
from unittest import mock

import pytest

import tiers

CACHE_ENV = 'ACCUM_CALLBACK_CACHE'   # = accum_finetune.pretrain.CACHE_ENV (not imported here: it loads torch)

@contextlib.contextmanager
def torch_threads(n:int):
    "torch's intra-op threads set to `n` for the block, then put back"
    import torch
    old = torch.get_num_threads(); torch.set_num_threads(n)
    try: yield
    finally: torch.set_num_threads(old)

@pytest.fixture
def one_thread():
    "One torch thread for the test: on two shared cores, one intra-op thread is several times faster than two fighting"
    with torch_threads(1): yield

@pytest.fixture(scope='session')
def cache_dir(tmp_path_factory):
    """A private cache holding the job's pretrained checkpoint, built once per session (the user's cache is never
    touched); pytest-xdist's workers share one, the first to arrive building it while the others wait for its lock"""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'): root = root.parent   # (the folder every worker's own lies in)
    d = root/'accum_cache'
    with FileLock(str(root/'accum_cache.lock')), mock.patch.dict(os.environ, {CACHE_ENV: str(d)}), torch_threads(1):
        from accum_finetune.pretrain import pretrained_checkpoint
        pretrained_checkpoint()
    return d

@pytest.fixture
def cache(cache_dir, monkeypatch):
    "The session's checkpoint path; `$ACCUM_CALLBACK_CACHE` points at its cache for this test only (subprocesses and kernels inherit it)"
    monkeypatch.setenv(CACHE_ENV, str(cache_dir))
    from accum_finetune.pretrain import pretrained_checkpoint
    return pretrained_checkpoint()   # (the shipped one: what the job loads)

_NOT_CHECKOUT = {'.git', '.venv', '__pycache__', '.pytest_cache', '.hypothesis', '.ipynb_checkpoints', 'build', 'dist', '.whl'}

def _checkout_paths(root)->set:
    "Every file and folder of the checkout but git's, the environment's and Python's caches"
    out = set()
    for d,dirs,files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _NOT_CHECKOUT and not x.endswith('.egg-info')]
        rel = os.path.relpath(d, root)
        out.update(os.path.join(rel, x) for x in dirs + files)
    return out

@pytest.fixture(scope='session', autouse=True)
def writes_nothing_into_the_checkout(tmp_path_factory):
    """No test leaves a file or folder in the checkout: the tests run from a temporary folder (a Learner's default path
    is the working directory, and fastai 2.7's `lr_find` leaves its `models/` there), and a test that still writes into
    the checkout fails the session"""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    before,cwd = _checkout_paths(root),os.getcwd()
    os.chdir(tmp_path_factory.mktemp('cwd'))
    try: yield
    finally: os.chdir(cwd)
    new = sorted(_checkout_paths(root) - before)
    assert not new, f'the tests left these in the checkout: {new}'

# -- the tiers ---------------------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption('--full', action='store_true', default=False,
                     help='the full tier: also the tests that start processes (marked `processes` by what they use)')

def pytest_configure(config):
    config.addinivalue_line('markers', 'processes: starts processes (gloo ranks, the job, torchrun, a notebook kernel, a '
                            'bench script); set by conftest.py from what the test uses, run with --full')
    tiers.ProcessWatch.install()
    if os.environ.get('PYTEST_XDIST_WORKER'):   # pytest-xdist's workers share the cores: one torch thread each, not one a core each
        import torch
        torch.set_num_threads(1)

def pytest_collection_modifyitems(config, items):
    "Mark every test that starts processes; outside the full tier, leave them out (deselected, counted by pytest)"
    keep,out = [],[]
    for item in items:
        fn = getattr(item, 'function', None)
        found = tiers.item_starters(fn, item.fixturenames, item.module) if fn is not None else []
        if found:
            item.add_marker(pytest.mark.processes)
            item.user_properties.append(('starts', ', '.join(found)))
        (out if found and not config.getoption('full') else keep).append(item)
    if out:
        config.hook.pytest_deselected(items=out)
        items[:] = keep

@pytest.fixture(autouse=True)
def _no_process_outside_the_full_tier(request):
    """An everyday-tier test that starts a process after all (a way `tiers.py` cannot read: a helper loaded by path, a
    method through `self`) fails, so that the everyday tier stays in this process"""
    if request.node.get_closest_marker('processes') is not None: yield; return
    with tiers.ProcessWatch() as w: yield
    if w.started():
        pytest.fail(f'{request.node.nodeid} starts a process ({w.started()}) that tests/tiers.py did not see: add the '
                    'function that starts it to tiers.STARTERS, or call it where the reading follows', pytrace=False)
