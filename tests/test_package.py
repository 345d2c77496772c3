"""The package as a whole: its modules form layers (each imports only those below it), the patches on fastai's Learner
exist whichever name is imported first, and a fit that shards nothing does not load torch's FSDP package."""
import ast, importlib.util, re, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT/'accum_callback'

def _imports(path:Path)->set:
    """The package's own modules a file imports, at its top or inside functions, as dotted paths under `accum_callback`
    (`from .x import`, `from ..core.x import`, `from . import x`, `from accum_callback.x import`)"""
    here = path.relative_to(PKG).with_suffix('').parts
    pkg = here[:-1] if here[-1] != '__init__' else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(pkg[:len(pkg) - (node.level - 1)])
            if node.module: out.add('.'.join(base + node.module.split('.')))
            else: out.update('.'.join(base + [a.name]) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('accum_callback.'):
            out.add(node.module.split('.', 1)[1])
    return out

def _module_of(dotted:str)->str:
    "The module a dotted import path names (`micro` is the micro package's face, which loads all of it)"
    import accum_callback
    return dotted if dotted in accum_callback._LAYERS else next((m for m in accum_callback._LAYERS if dotted.startswith(m + '.')), dotted)

def _files()->dict:
    "Every module of the package as its dotted path, with its file (a subpackage's face, `__init__.py`, under its package's name)"
    out = {}
    for p in PKG.rglob('*.py'):
        parts = p.relative_to(PKG).with_suffix('').parts
        if parts in (('__init__',), ('__main__',)): continue
        out['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = p
    return out

def test_the_package_is_in_tiers_each_importing_its_own_and_those_below():
    """Issue 60: at most 12 top-level rooms (subpackages and modules), in tiers (`accum_callback._TIERS`): a module
    imports only modules of its own tier that come before it and modules of tiers below, so no circle and no arrow back
    up; every module is in the list and every listed one exists"""
    import accum_callback
    tiers = accum_callback._TIERS
    top = {p.name if p.is_dir() else p.stem for p in PKG.iterdir() if (p.is_dir() and (p/'__init__.py').exists()) or p.suffix == '.py'} - {'__init__'}
    assert len(top) <= 12, sorted(top)
    assert {t for t,_ in tiers} == top - {'__main__'}, {t for t,_ in tiers} ^ (top - {'__main__'})
    files = _files()
    listed = set(accum_callback._LAYERS)
    faces = {t for t,ms in tiers if ms}   # (a subpackage's face: a docstring, and names loaded lazily or handed on)
    assert set(files) == listed | faces, set(files) ^ (listed | faces)
    for i,(t,ms) in enumerate(tiers):
        below = {f'{u}.{m}' if m else u for u,ms2 in tiers[:i] for m in (ms2 or ('',))} | {u for u,_ in tiers[:i]}
        for j,m in enumerate(ms or ('',)):
            name = f'{t}.{m}' if m else t
            before = {f'{t}.{x}' for x in (ms or ())[:j]} | {t}
            ups = {d for d in _imports(files[name]) if _module_of(d) not in below | before}
            assert not ups, f'{name} imports {sorted(ups)}: not below it in accum_callback._TIERS'
    assert any(d.startswith('core.') for d in _imports(files['micro.loader']))   # (the imports are read)

@pytest.mark.parametrize('first', ['GradientAccumulation', 'bn_to_groupnorm'])
def test_the_learner_has_every_patch_whichever_name_comes_first(first):
    code = (f"from accum_callback import {first}\nfrom fastai.learner import Learner\n"
            "print(all(hasattr(Learner, n) for n in ('accumulate', 'check_accumulation', 'to_fsdp', 'from_fsdp', 'fsdp_ctx')))")
    res = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.stdout.strip() == 'True', res.stderr[-2000:]

def test_a_fit_that_shards_nothing_does_not_load_fsdp():
    "`bench/fit_memory.py`'s fit, in a fresh process: torch's FSDP package and DTensor stay unloaded (44 MiB of peak memory)"
    import fit_memory   # (bench/ is on the tests' path: setup.cfg)
    now = fit_memory.run('now')
    assert not now['fsdp'] and not now['dtensor']

# -- torch outside its public API: only through accum_callback/compat/torch.py -----------------------------------------------
PRIVATE_ATTRS = {'_buffers', '_modules', '_get_fsdp_state', '_fsdp_param_groups', '_unsharded_param', 'unsharded_accumulated_grad',
                 '_orig_mod', '_torchdynamo_orig_backend', '_BatchNorm', '_utils', '_pytree'}

def _private_uses(path:Path)->list:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (node.attr in PRIVATE_ATTRS or node.attr.startswith('_foreach')):
            out.append(f'{path.name}:{node.lineno} .{node.attr}')
        if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'torch':
            if any(p.startswith('_') for p in node.module.split('.')) or any(a.name.startswith('_') for a in node.names):
                out.append(f'{path.name}:{node.lineno} from {node.module} import ...')
    return out

def test_private_torch_names_are_reached_only_through_compat():
    files = [p for d in ('accum_callback', 'accum_finetune') for p in (ROOT/d).rglob('*.py') if p != PKG/'compat'/'torch.py']
    found = [u for p in files for u in _private_uses(p)]
    assert not found, f'private torch names outside accum_callback/compat/torch.py (add a helper there): {found}'
    assert _private_uses(PKG/'compat'/'torch.py'), 'the check reads nothing'   # it does find them where they are

@pytest.mark.parametrize('name,args', [('mul_', (2.,)), ('copy_', 'dst'), ('add_', (1.,)), ('add', (0.5,)), ('sqrt_', ()),
                                       ('div', 'dst'), ('clamp_min_', ([0.1, -0.2],)), ('clamp_max_', ([0.3, 0.2],)), ('norm', ())])
def test_foreach_falls_back_to_a_loop_with_the_same_result(name, args):
    import torch
    from accum_callback.compat.torch import _loop, foreach
    mk = lambda: [torch.rand(3, generator=torch.Generator().manual_seed(i)) + 0.1 for i in range(2)]
    if args == 'dst': args = ([t + 1 for t in mk()],)
    a,b = mk(),mk()
    ra,rb = foreach(name)(a, *args),_loop(name)(b, *args)
    assert foreach(name) is getattr(torch, f'_foreach_{name}')   # this torch has the fused one
    for x,y in zip(ra or a, rb or b): assert torch.allclose(x, y)

def test_tree_helpers_round_trip():
    import collections, torch
    from accum_callback.compat.torch import tree_flatten, tree_map, tree_unflatten
    P = collections.namedtuple('P', 'a b')
    obj = dict(x=[torch.ones(1), (2, P(3, [4]))], y=collections.defaultdict(list, z=5), w=())
    leaves,spec = tree_flatten(obj)
    assert leaves[1:] == [2, 3, 4, 5] and tree_unflatten(leaves, spec) == obj | {}
    back = tree_map(lambda v: v, obj)
    assert type(back['x'][1][1]) is P and back['y'].default_factory is list and back['w'] == ()

class _FSDPParam214:
    "The shape of torch 2.14's FSDPParam: the reduce-dtype accumulator is a plain attribute"
    def __init__(self, up, acc): self._unsharded_param,self.unsharded_accumulated_grad = up,acc

class _FSDPParam215:
    "torch 2.15's: a read-only property, the unsharded parameter's own .grad"
    def __init__(self, up): self._unsharded_param = up
    @property
    def unsharded_accumulated_grad(self): return self._unsharded_param.grad

@pytest.mark.parametrize('cls', [_FSDPParam214, _FSDPParam215])
def test_held_fsdp_grads_cleared_in_either_layout(cls):
    "Found by what the class has (an attribute, or a property without setter), not by torch's version number"
    import torch
    from accum_callback.compat.torch import clear_held_grads, held_unsharded_grad
    up = torch.nn.Parameter(torch.zeros(3)); up.grad = torch.ones(3)
    fp = cls(up, torch.full((3,), 2.)) if cls is _FSDPParam214 else cls(up)
    assert float(held_unsharded_grad(fp).sum()) == (6. if cls is _FSDPParam214 else 3.)
    clear_held_grads(fp)
    assert up.grad is None and held_unsharded_grad(fp) is None

def test_fsdp2_whose_grads_cannot_be_reached_is_refused_naming_torch(monkeypatch):
    import torch
    from accum_callback.core import distributed as D
    monkeypatch.setattr(D, 'is_fsdp', lambda m: True)
    monkeypatch.setattr(D, 'fsdp_modules', lambda m: [torch.nn.Linear(1, 1)])   # no `_get_fsdp_state`: unreachable
    with pytest.raises(ValueError, match=rf"FSDP2.*torch {re.escape(torch.__version__)}.*docs/versions.md"): D.check_fsdp(torch.nn.Linear(1, 1))

# -- versions ------------------------------------------------------------------------------------------------------------
def test_one_version_number_in_the_package_setup_and_changelog():
    import accum_callback
    from importlib.metadata import version, PackageNotFoundError
    assert 'version = attr: accum_callback.__version__' in (ROOT/'setup.cfg').read_text()   # setup.cfg reads the package's
    assert f'## {accum_callback.__version__} ' in (ROOT/'CHANGELOG.md').read_text()
    try: installed = version('accum_callback')
    except PackageNotFoundError:   # a checkout on PYTHONPATH, not installed (the GPU machine's run): no metadata to be stale
        pytest.skip('accum_callback is not installed (run from a checkout on PYTHONPATH): no installed metadata to compare')
    assert installed == accum_callback.__version__, 'the installed metadata is stale: pip install -e .'

def test_lower_bounds_are_the_versions_ci_runs_the_oldest_tier_on():
    "setup.cfg claims no older torch, torchvision or fastai than `.ci/versions oldest` installs (major.minor, fastai's patch)"
    oldest = dict(re.findall(r'(torch|torchvision|fastai)==([\d.]+)', re.search(r'OLDEST="([^"]*)"', (ROOT/'.ci'/'versions').read_text()).group(1)))
    claims = dict(re.findall(r'^\s+(torch|torchvision|fastai)>=([\d.]+)', (ROOT/'setup.cfg').read_text(), re.M))
    assert set(claims) == set(oldest) == {'torch', 'torchvision', 'fastai'}
    for k,v in claims.items():
        n = 3 if k == 'fastai' else 2
        assert oldest[k].split('.')[:n] == v.split('.')[:n], f'{k}: setup.cfg says >={v}, CI tests {oldest[k]}'

def test_importing_the_package_adds_only_plain_functions_to_fastais_learner():
    """`import accum_callback` (every module loaded) changes nothing of fastai's `Learner` class but adding plain
    functions (fastcore's `@patch`), each listed in docs/api.md as `Learner.<name>`: no property, no replaced method"""
    code = ("import warnings, json, types; warnings.filterwarnings('ignore')\n"
            "from fastai.learner import Learner\nimport fastai.vision.all\n"
            "before = dict(Learner.__dict__)\n"
            "import accum_callback; accum_callback.GradientAccumulation\n"
            "after = dict(Learner.__dict__)\n"
            "print(json.dumps(dict(added={k: isinstance(v, types.FunctionType) for k,v in after.items() if k not in before},\n"
            "    changed=[k for k in before if after.get(k) is not before[k]])))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = __import__('json').loads(r.stdout.strip().splitlines()[-1])
    assert res['changed'] == [] and res['added'] and all(res['added'].values()), res
    api = (ROOT/'docs'/'api.md').read_text()
    assert all(f'## `Learner.{k}`' in api for k in res['added']), [k for k in res['added'] if f'## `Learner.{k}`' not in api]

FASTAI_PRIVATE = {'_with_events', '_train_mets', '_valid_mets', 'fake_l', '_do_epoch', '_do_fit', '_do_one_batch', '_end_cleanup'}

def test_private_fastai_names_are_reached_only_through_fastai_compat():
    "As torch's in compat.py: a fastai name outside its public API (an attribute or a string naming one) sits in fastai_compat.py"
    found = []
    for path in sorted(PKG.rglob('*.py')):
        if path == PKG/'compat'/'fastai.py': continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if name in FASTAI_PRIVATE: found.append(f'{path.relative_to(PKG)}:{node.lineno} {name}')
    assert not found, found

# -- the structure (issue 53) ---------------------------------------------------------------------------------------------
PKG = Path(__file__).resolve().parents[1]/'accum_callback'

def _code_lines(src:str, node)->int:
    "Lines of `node` that hold code: no blank line, comment or docstring line (a line with a docstring and code counts)"
    import ast
    tree,lines,doc = ast.parse(src),src.splitlines(),set()
    for n in ast.walk(tree):
        body = getattr(n, 'body', None)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and isinstance(body[0], ast.Expr) \
           and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            d = body[0]
            doc.update(i for i in range(d.lineno, d.end_lineno+1) if i > d.lineno or lines[i-1].lstrip()[:1] in '"\'')
    return sum(1 for i in range(node.lineno, node.end_lineno+1)
               if lines[i-1].strip() and not lines[i-1].strip().startswith('#') and i not in doc)

def test_no_module_over_400_lines_and_gradient_accumulation_an_adapter():
    """Every module of the package at most 400 lines; `GradientAccumulation` at most 150 code lines (it holds the events;
    the window, its plan, the ranks' sync and its log are modules of their own)"""
    import ast
    long = {p.relative_to(PKG).as_posix(): n for p in PKG.rglob('*.py') if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    src = (PKG/'window'/'accumulate.py').read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == 'GradientAccumulation')
    assert _code_lines(src, cls) <= 150, _code_lines(src, cls)

def test_checkpoint_is_a_manager_of_pieces():
    """Issue 61: `Checkpoint` says when, where and which file; the fit's state is pieces (`fit_place.FitPlace`,
    `fit_state.training_state`, every callback's `state_dict()`), so no module of `resume/` imports the modules that
    define `GradientAccumulation`, `BatchNormAccumulation`, `MicroBatching` (issue 60: the signature is what the
    callbacks declare, `ResumeSignature`; the window's owner is found by `WindowOwner`), the file format imports nothing
    of the window (its state is plain), and the class is at most 200 code lines"""
    files = _files()
    features = {'window.accumulate', 'batchnorm', 'batchnorm.callback', 'micro', 'micro.callback'}
    for m in [m for m in files if m.startswith('resume.')]:
        bad = {d for d in _imports(files[m]) if d in features or d.startswith('micro.callback')}
        assert not bad, f'{m} imports {sorted(bad)}'
    assert not {d for d in _imports(files['resume.format']) if d.startswith('window')}
    import ast
    src = (PKG/'resume'/'checkpoint.py').read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == 'Checkpoint')
    assert _code_lines(src, cls) <= 200, _code_lines(src, cls)

# where a module's tests are when they are not in tests/test_<module's last name>.py (each file named must name the module)
TESTED_IN = {'compat.torch': 'test_package.py', 'compat.fastai': 'test_package.py', 'core.args': 'test_validate.py',
             'core.files': 'test_resume.py', 'core.losses': 'test_losses.py', 'core.distributed': 'test_distributed.py',
             'core.loaders': 'test_resume.py', 'core.protocols': 'test_guard.py', 'window.state': 'test_window.py',
             'window.log': 'test_accumulate.py', 'window.global_window': 'test_global_order.py',
             'batchnorm.modes': 'test_batchnorm.py', 'batchnorm.norm_layers': 'test_batchnorm.py',
             'batchnorm.pool': 'test_batchnorm.py', 'batchnorm.callback': 'test_batchnorm.py',
             'check.batchnorm': 'test_precise.py', 'check.accumulation': 'test_check.py', 'noise.scale': 'test_noise.py',
             'noise.measure': 'test_noise.py', 'resume.format': 'test_resume.py', 'resume.fit_state': 'test_resume.py',
             'resume.fit_place': 'test_resume.py', 'resume.world_size': 'test_global_order.py',
             'resume.sharded': 'test_global_order.py', 'resume.checkpoint': 'test_resume.py', 'fsdp': 'test_distributed.py',
             'testing': 'test_distributed.py', 'micro.pieces': 'test_micro_bs.py', 'micro.state': 'test_micro_bs.py',
             'micro.retry': 'test_micro_bs.py', 'micro.inference': 'test_micro_bs.py', 'micro.loader': 'test_micro_bs.py',
             'micro.callback': 'test_micro_bs.py', 'core.batches': 'test_everyday.py',
             'batchnorm.window_stats': 'test_bn_window.py'}

def test_every_module_has_its_tests_where_this_map_says():
    "tests/test_<module's last name>.py, or the file `TESTED_IN` names, which names the module (a module without tests fails here)"
    import accum_callback
    here = Path(__file__).parent
    for m in accum_callback._LAYERS:
        last = m.rsplit('.', 1)[-1]
        f = here/TESTED_IN[m] if m in TESTED_IN else here/f'test_{last}.py'
        assert f.exists(), f"accum_callback.{m} has no tests/test_{last}.py and no entry in TESTED_IN"
        assert f == here/f'test_{last}.py' or any(x in f.read_text() for x in (m, last, m.split('.')[0])), f"{f.name} does not name {m}"

def test_importing_the_package_changes_no_import_machinery_and_0_2_paths_are_gone():
    "No finder is installed at import (a reload included); 0.2's module paths are gone (docs/versions.md lists the moves)"
    import importlib, sys, accum_callback
    before = list(sys.meta_path)
    importlib.reload(accum_callback)
    assert sys.meta_path == before
    with pytest.raises(ModuleNotFoundError): importlib.import_module('accum_callback.precise')
    with pytest.raises(ImportError): exec('from accum_callback.window import Window', {})
    versions = (ROOT/'docs'/'versions.md').read_text()
    assert '`accum_callback.precise`' in versions and '`accum_callback.batchnorm.precise`' in versions

def test_no_private_name_is_imported_across_the_packages_modules():
    "Issue 60: a module uses another's public names only (`from .x import _y` is a private name crossing a boundary)"
    found = []
    for path in sorted(PKG.rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or '').startswith('accum_callback')):
                found += [f'{path.relative_to(PKG)}:{node.lineno} {a.name}' for a in node.names if a.name.startswith('_') and not a.name.startswith('__')]
    assert not found, found

def test_the_training_loader_wrappers_are_read_by_their_protocol_only():
    """The loaders the package puts over fastai's (`ReadAhead`, `MicroBatches`) declare one protocol
    (`core.loaders.FeedLoader`: `feed_of`, `piece_of`, `is_last_batch`, `inner_loader`): outside core/loaders.py nothing
    guesses at them with `getattr(learn.dl, ...)`"""
    import re
    from accum_callback.core.loaders import FeedLoader, ReadAhead
    from accum_callback.micro.loader import MicroBatches
    assert issubclass(ReadAhead, FeedLoader) and issubclass(MicroBatches, FeedLoader)
    guess = re.compile(r"(getattr|hasattr)\((self\.)?learn\.dl\b")
    bad = [f"{p.relative_to(PKG)}:{i}" for p in sorted(PKG.rglob('*.py')) if p != PKG/'core'/'loaders.py'
           for i,line in enumerate(p.read_text().splitlines(), 1) if guess.search(line)]
    assert not bad, bad
