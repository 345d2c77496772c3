"""The two test tiers, decided by what a test uses, never by hand.

A test *starts processes* when its body, a fixture it asks for or a helper of the suite they name (followed through
tests/, bench/ and nbs/, transitively) calls one of `STARTERS`: `subprocess`'s functions, `os.fork`/`system`/`spawn*`,
`multiprocessing`'s processes, `accum_callback.testing.launch_gloo` (the gloo ranks), `nbclient`'s kernel, torchrun.
`conftest.py` marks such a test `processes`; the everyday tier (`python -m pytest`) leaves them out and the full tier
(`python -m pytest --full`) runs them. Names are resolved to the objects they are bound to (through the module's globals,
`import x as y` and `from x import y` included), so a renamed import is still found.

What the reading cannot follow (a helper loaded by path with importlib, a method reached through `self`) is caught when
the test runs: `ProcessWatch` sees every child process (Python's audit events for `subprocess`, `os.fork`, `os.system`,
`os.posix_spawn`, and the CPU time of reaped children, which covers `multiprocessing`'s spawn), and an everyday-tier
test that started one fails, naming the way to teach this module about it."""
from __future__ import annotations
import ast, functools, importlib, inspect, os, subprocess, sys, textwrap, traceback, types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLLOWED = tuple(str(ROOT/d) + os.sep for d in ('tests', 'bench', 'nbs'))   # the suite's own helpers are read, not the package's

def _starters()->dict:
    "The objects that start a process, each with the words a report uses"
    import multiprocessing
    out = {getattr(subprocess, n): f'subprocess.{n}' for n in ('run', 'Popen', 'call', 'check_call', 'check_output', 'getoutput', 'getstatusoutput')}
    out.update({getattr(os, n): f'os.{n}' for n in ('fork', 'forkpty', 'system', 'popen', 'posix_spawn', 'posix_spawnp', 'spawnv',
                                                     'spawnve', 'spawnl', 'spawnle', 'spawnvp', 'spawnlp', 'execv', 'execve') if hasattr(os, n)})
    out.update({multiprocessing.Process: 'multiprocessing.Process', multiprocessing.get_context: 'multiprocessing.get_context',
                multiprocessing.Pool: 'multiprocessing.Pool'})
    from accum_callback import testing
    out[testing.launch_gloo] = 'launch_gloo (gloo ranks)'
    try:
        import torch.multiprocessing as tmp
        out[tmp.spawn] = 'torch.multiprocessing.spawn'; out[tmp.start_processes] = 'torch.multiprocessing.start_processes'
    except ImportError: pass
    try:
        import jupyter_client.manager as jm
        out[jm.start_new_kernel] = 'jupyter_client.start_new_kernel (a kernel)'; out[jm.KernelManager] = 'jupyter_client.KernelManager (a kernel)'
    except ImportError: pass
    try:
        import nbclient
        out[nbclient.NotebookClient] = 'nbclient.NotebookClient (a kernel)'
        out[nbclient.execute] = 'nbclient.execute (a kernel)'
    except ImportError: pass
    return out

STARTERS = _starters()
_BY_ID = {id(k): v for k,v in STARTERS.items()}

def _source_tree(fn):
    "The AST of a function of the suite (from its file: decorators and all), or None"
    try: src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError): return None
    try: return ast.parse(src)
    except SyntaxError: return None

def _ours(obj)->bool:
    f = getattr(getattr(obj, '__code__', None), 'co_filename', None)
    if f is None and isinstance(obj, type): f = getattr(sys.modules.get(obj.__module__), '__file__', None)
    return bool(f) and str(f).startswith(FOLLOWED)

def _chain(node)->str|None:
    "The dotted name `node` reads (`a`, `a.b`, `a.b.c`), or None"
    parts = []
    while isinstance(node, ast.Attribute): parts.append(node.attr); node = node.value
    return '.'.join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None

def _chains(tree)->tuple[set,set]:
    "Every dotted name read in `tree`, and those called (`f(...)`)"
    read = {c for node in ast.walk(tree) if (c := _chain(node))}
    called = {c for node in ast.walk(tree) if isinstance(node, ast.Call) and (c := _chain(node.func))}
    return read, called

def _resolve(chain:str, ns:dict):
    "The object `chain` names in the namespace `ns` (through modules and classes only: no property is run), or None"
    head,*rest = chain.split('.')
    obj = ns.get(head, getattr(__builtins__, head, None) if not isinstance(__builtins__, dict) else __builtins__.get(head))
    for a in rest:
        if not isinstance(obj, (types.ModuleType, type)): return None
        obj = inspect.getattr_static(obj, a, None)
        if isinstance(obj, (staticmethod, classmethod)): obj = obj.__func__
    return obj

def _target(fn):
    "A fixture's function, a decorated function's own"
    fn = getattr(fn, '_get_wrapped_function', lambda: fn)() if type(fn).__name__ == 'FixtureFunctionDefinition' else fn
    fn = getattr(getattr(fn, 'hypothesis', None), 'inner_test', fn)   # (a hypothesis `@given` test: its own body)
    return inspect.unwrap(fn) if callable(fn) else fn

_EDGES:dict = {}

def _edges(fn)->tuple:
    "(the starters `fn` names itself, the suite's functions and classes it names), read once per function"
    key = id(fn)
    if key in _EDGES: return _EDGES[key][1]
    found,follow = set(),[]
    if id(fn) in _BY_ID: found.add(_BY_ID[id(fn)])
    elif isinstance(fn, type):
        follow = [getattr(m, '__func__', m) for m in vars(fn).values() if isinstance(m, (types.FunctionType, staticmethod, classmethod))]
    elif isinstance(fn, types.FunctionType) and (tree := _source_tree(fn)) is not None:
        ns = dict(fn.__globals__)
        if fn.__closure__: ns.update({n: c.cell_contents for n,c in zip(fn.__code__.co_freevars, fn.__closure__) if _filled(c)})
        ns.update(_local_imports(tree))
        read,called = _chains(tree)
        for chain in read:
            obj = _resolve(chain, ns)
            if obj is None: continue
            if id(obj) in _BY_ID:   # a starter called here (only named, as `os.system` in a planted pickle, it starts nothing)
                if chain in called: found.add(_BY_ID[id(obj)])
            elif _ours(obj): follow.append(_target(obj))
    _EDGES[key] = (fn, (found, follow))   # (the object is kept: its id stays its own)
    return found, follow

def _module(name:str):
    "The module `name` (imported if it is not yet: the test imports it anyway), or None"
    try: return importlib.import_module(name)
    except Exception: return None

def _local_imports(tree)->dict:
    """The names a function binds to modules and their members inside its body: `import a.b as c`, `from a import b`,
    `x = pytest.importorskip('a')` / `importlib.import_module('a')`"""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname: out[a.asname] = _module(a.name)
                else: out[a.name.split('.')[0]] = _module(a.name.split('.')[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            m = _module(node.module)
            for a in node.names:
                v = inspect.getattr_static(m, a.name, None) if m is not None else None
                out[a.asname or a.name] = v if v is not None else _module(f'{node.module}.{a.name}')
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args
              and isinstance(node.value.args[0], ast.Constant) and isinstance(node.value.args[0].value, str)
              and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in ('importorskip', 'import_module')):
            for t in node.targets:
                if isinstance(t, ast.Name): out[t.id] = _module(node.value.args[0].value)
    return {k: v for k,v in out.items() if v is not None}

def starters_of(*fns)->list:
    """The process starters that `fns` reach (their code and the suite's helpers they name, transitively):
    `['launch_gloo (gloo ranks)']`, empty for code that runs in this process"""
    found,seen,todo = set(),set(),[_target(f) for f in fns]
    while todo:
        fn = todo.pop()
        if id(fn) in seen: continue
        seen.add(id(fn))
        direct,follow = _edges(fn)
        found |= direct; todo += follow
    return sorted(found)

def _filled(cell)->bool:
    try: cell.cell_contents; return True
    except ValueError: return False

def fixture_function(name:str, module):
    """The function of fixture `name` as `module` (a test module) sees it: defined there, or in a conftest.py of its
    folder or above; None for pytest's own (tmp_path, monkeypatch...)"""
    obj = getattr(module, name, None)
    if obj is not None and _is_fixture(obj): return obj
    d = Path(module.__file__).resolve().parent
    for folder in (d, *d.parents):
        conf = sys.modules.get(_conftest_name(folder))
        if conf is not None and _is_fixture(getattr(conf, name, None)): return getattr(conf, name)
        if folder == ROOT: break
    return None

@functools.lru_cache(maxsize=None)
def _conftest_name(folder:Path)->str:
    for m in list(sys.modules.values()):
        f = getattr(m, '__file__', None)
        if f and Path(f).name == 'conftest.py' and Path(f).resolve().parent == folder: return m.__name__
    return ''

def _is_fixture(obj)->bool:
    return obj is not None and (type(obj).__name__ == 'FixtureFunctionDefinition' or hasattr(obj, '_pytestfixturefunction'))

def item_starters(fn, fixturenames, module)->list:
    "What a test (`fn` with its fixtures' names, in `module`) reaches that starts a process"
    return starters_of(fn, *[f for f in (fixture_function(n, module) for n in fixturenames) if f is not None])

# -- at run time: a child process that the reading missed -------------------------------------------------------------
_AUDITED = {'subprocess.Popen', 'os.fork', 'os.forkpty', 'os.system', 'os.posix_spawn', 'os.spawn', 'os.exec'}

class ProcessWatch:
    """Counts the child processes started in this process from now on (one audit hook for the session). A torch
    `DataLoader`'s worker processes are part of training in this process, not a process the test starts: not counted"""
    events:list = []
    loader_workers = 0
    installed = False
    @classmethod
    def install(cls):
        if cls.installed: return
        sys.addaudithook(cls._hook); cls.installed = True
    @classmethod
    def _hook(cls, event, args):
        if event not in _AUDITED: return
        if any('torch/utils/data/' in f.filename.replace(os.sep, '/') for f in traceback.extract_stack(limit=40)):
            cls.loader_workers += 1; return
        cls.events.append(f'{event} {str(args[0])[:120] if args else ""}'.strip())
    def __enter__(self):
        self.n0,self.w0,self.t0 = len(self.events),self.loader_workers,self._child_cpu()
        return self
    def __exit__(self, *exc): self.n1,self.w1,self.t1 = len(self.events),self.loader_workers,self._child_cpu()
    @staticmethod
    def _child_cpu()->float: t = os.times(); return t.children_user + t.children_system
    def started(self)->str:
        "What was started (the audit events), or the reaped children's CPU time where no loader worker ran; '' if nothing"
        ev = self.events[self.n0:self.n1]
        if ev: return '; '.join(ev[:3])
        if self.t1 > self.t0 and self.w1 == self.w0: return f'child processes ran ({self.t1 - self.t0:.2f} s of CPU; multiprocessing?)'
        return ''
