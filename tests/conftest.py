"Fixtures shared by the test modules. None leaves anything behind: environment changes last one test (monkeypatch)."
import contextlib, os
from unittest import mock

import pytest

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
    "A private cache holding the job's pretrained checkpoint, built once per session (the user's cache is never touched)"
    d = tmp_path_factory.getbasetemp()/'accum_cache'
    with mock.patch.dict(os.environ, {CACHE_ENV: str(d)}), torch_threads(1):
        from accum_finetune.pretrain import pretrained_checkpoint
        pretrained_checkpoint()
    return d

@pytest.fixture
def cache(cache_dir, monkeypatch):
    "The session's checkpoint path; `$ACCUM_CALLBACK_CACHE` points at its cache for this test only (subprocesses and kernels inherit it)"
    monkeypatch.setenv(CACHE_ENV, str(cache_dir))
    from accum_finetune.pretrain import checkpoint_path
    return checkpoint_path()

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
