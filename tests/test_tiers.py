"""The tiers (`tiers.py`, `conftest.py`): a test that starts processes is found by what it uses, through the suite's
helpers and fixtures, and every test file keeps tests in the everyday tier."""
import importlib, inspect, os, subprocess as sp, sys
from pathlib import Path

import pytest

import tiers
from accum_callback.testing import launch_gloo as gloo

HERE = Path(__file__).resolve().parent

# -- what the reading must find, and what it must leave in this process ---------------------------------------------
def _helper(): return sp.run([sys.executable, '-c', 'pass'])   # an aliased module
def _through_a_helper(): return _helper()
def _ranks(): return gloo(print)                                # a renamed import of the launcher
class _Runner:
    @staticmethod
    def go(): return _helper()
def _through_a_class(): return _Runner.go()
def _plain(x): return sorted(x) + [os.path.join('a', 'b')]      # os, but nothing that starts a process
def _recursive(n): return n if n < 1 else _recursive(n - 1)
def _named_only(): return (os.system, ('true',))                 # a pickle's payload names it: nothing is started

# (named, not passed: a test's decorators are read too, and these would put this test in the full tier)
@pytest.mark.parametrize('name,expected', [
    ('_helper', ['subprocess.run']), ('_through_a_helper', ['subprocess.run']), ('_ranks', ['launch_gloo (gloo ranks)']),
    ('_through_a_class', ['subprocess.run']), ('_plain', []), ('_recursive', []), ('_named_only', [])])
def test_the_reading_finds_process_starters_through_helpers_and_renamed_imports(name, expected):
    assert tiers.starters_of(vars(sys.modules[__name__])[name]) == expected

def test_a_fixture_that_starts_processes_marks_the_tests_that_ask_for_it():
    bench = importlib.import_module('test_bench')
    assert tiers.item_starters(lambda: None, ['quick'], bench) == ['subprocess.run']   # test_bench's `quick` runs the script
    assert tiers.item_starters(lambda: None, ['tmp_path', 'one_thread'], bench) == []   # pytest's and conftest's in-process ones

def _test_files()->list: return sorted(HERE.glob('test_*.py'))

def _everyday_tests(mod)->list:
    "The tests of a module that run in the everyday tier (by the reading conftest.py uses)"
    out = []
    for name,fn in vars(mod).items():
        if name.startswith('test_') and inspect.isfunction(fn):
            if not tiers.item_starters(fn, list(inspect.signature(fn).parameters), mod): out.append(name)
    return out

def test_every_test_file_has_tests_in_the_everyday_tier():
    "The README's `python -m pytest` exercises every test file (so every module), not only the full tier"
    empty = [p.name for p in _test_files() if not _everyday_tests(importlib.import_module(p.stem))]
    assert not empty, f'these test files run only in the full tier (--full): {empty}; give each an in-process test'

def test_the_tiers_split_what_the_session_collected(request):
    "The everyday session deselects exactly the tests marked `processes`; the full tier keeps them"
    full = request.config.getoption('full')
    items = request.session.items
    assert full or not any(i.get_closest_marker('processes') for i in items)
    assert any(i.nodeid.startswith('tests/test_tiers.py') for i in items)

# -- at run time: what the reading cannot see -------------------------------------------------------------------------
def _mp_child(): pass

def test_the_watch_sees_processes_the_reading_cannot():
    """A process started through a name the reading cannot resolve (looked up at run time), and a multiprocessing spawn
    (no audit event: the reaped child's CPU time), are both seen; nothing started, nothing seen"""
    import multiprocessing
    run = getattr(__import__('subprocess'), 'run')
    with tiers.ProcessWatch() as w: run([sys.executable, '-c', 'pass'])
    assert 'subprocess.Popen' in w.started()
    ctx = multiprocessing.get_context('spawn')
    with tiers.ProcessWatch() as w:
        p = ctx.Process(target=_mp_child); p.start(); p.join()
    assert w.started()
    with tiers.ProcessWatch() as w: sum(range(1000))
    assert w.started() == ''
    sp.run([sys.executable, '-c', 'pass'])   # (what the reading sees: this test is in the full tier)

def test_ci_and_the_readme_run_both_tiers():
    """The README names both test commands; `.ci/run` runs the everyday one on the pinned versions last, and the full
    tier after it with CI_FULL=1"""
    root = HERE.parent
    readme,ci = (root/'README.md').read_text(),(root/'.ci'/'run').read_text()
    for cmd in ('python -m pytest\n', 'python -m pytest --full'):
        assert cmd in readme, cmd
    lines = [l.strip() for l in ci.splitlines() if 'pytest' in l and not l.lstrip().startswith('#')]
    assert lines[-2:] == ['step python -m pytest', 'if [ "${CI_FULL:-0}" = 1 ]; then step python -m pytest --full; fi'], lines
