"""The command line's checks that need neither torch nor fastai, so that bad input answers in milliseconds instead of
after torch's import: the `--data` path, whether this machine has a GPU at all (for `--device`/`--precision`), and
`--arch` names, read from the model registries' source files. Each says "surely bad" only when it is sure; where it
cannot tell without torch (a GPU driver present, a registry it cannot read), the full check after torch loads
decides."""
from __future__ import annotations
import functools, importlib.util, os, re, sys
from pathlib import Path

__all__ = ['data_problem', 'gpu_visible', 'arch_known', 'unknown_arch', 'registry_names']

def data_problem(path)->str|None:
    "What is wrong with `--data path` that a look at the folder shows (None: nothing yet; images are checked later)"
    path = Path(path)
    if not path.exists(): return f"--data {path}: no such folder"
    if not path.is_dir(): return f"--data {path}: not a folder"
    try: subs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith('.')]
    except PermissionError: return f"--data {path}: not readable"
    if not subs: return f"--data {path}: empty (expected one sub-folder of images per class, or train/ and valid/)"
    return None

_GPU_NODES = ('/dev/nvidiactl', '/dev/nvidia0', '/proc/driver/nvidia', '/dev/kfd', '/dev/dxg')   # NVIDIA, ROCm, WSL2

def gpu_visible()->bool|None:
    "False where this machine surely has no GPU torch could use (Linux without a GPU driver's device), else None"
    if os.environ.get('CUDA_VISIBLE_DEVICES', None) in ('', '-1') and not os.path.exists('/dev/kfd'): return False
    if not sys.platform.startswith('linux'): return None
    if any(os.path.exists(p) for p in _GPU_NODES) or any(n.startswith('nvidia') for n in _listdir('/dev')): return None
    return False

def _listdir(d):
    try: return os.listdir(d)
    except OSError: return []

# `@register_model` / `@register_model()` above a `def`, possibly under more decorators; and timm's deprecated names
_DEF = re.compile(r'^@register_(?:model|arch)\b[^\n]*(?:\n@[^\n]*)*\ndef\s+(\w+)', re.M)
_DEPRECATED = re.compile(r'register_model_deprecations\(\s*__name__\s*,\s*\{(.*?)\}\s*\)', re.S)

@functools.lru_cache(maxsize=None)
def registry_names(package:str, folder:str, recursive:bool=False)->frozenset|None:
    """Names a package registers with a decorator in `package/folder/*.py`, read without importing it (None: not
    installed)"""
    try: spec = importlib.util.find_spec(package)
    except (ImportError, ValueError): return None
    if spec is None or not spec.submodule_search_locations: return None
    root = Path(next(iter(spec.submodule_search_locations)))/folder
    names = set()
    for f in (root.rglob('*.py') if recursive else root.glob('*.py')):
        try: s = f.read_text(errors='ignore')
        except OSError: continue
        names.update(_DEF.findall(s))
        for blk in _DEPRECATED.findall(s): names.update(re.findall(r'[\'"](\w+)[\'"]\s*:', blk))
    return frozenset(names)

def arch_known(name:str)->bool|None:
    """Is `--arch name` one `models.check_arch` accepts? True/False where the registries' sources say, None where only
    importing them can tell (a registry that reads as nearly empty, a hub name)"""
    own = registry_names('accum_finetune', '.')
    if own and name in own: return True
    is_timm = name.startswith(('timm/', 'timm:'))
    bare = name[5:] if is_timm else name
    if not is_timm:
        tv = registry_names('torchvision', 'models')
        if tv is None or len(tv) < 20: return None
        if name in tv: return True
    if bare.startswith('hf-hub:') or bare.startswith('hf_hub:'): return None
    timm = registry_names('timm', 'models')
    if timm is None: return False   # models.check_arch: timm names need timm
    if len(timm) < 100: return None
    return bare.split('.', 1)[0] in timm   # a pretrained tag ('resnet50.a1_in1k') names the same architecture

def unknown_arch(name:str, timm_installed:bool)->str:
    "The one-line refusal of `--arch name` (shared with `models.check_arch`)"
    if not timm_installed:
        if name.startswith(('timm/', 'timm:')):
            return f"--arch {name}: timm is not installed (`pip install timm` for timm models)"
        return (f"--arch {name}: unknown architecture (not registered, not in torchvision; timm is not installed, so "
                "timm names are unavailable)")
    return f"--arch {name}: unknown architecture (not registered, not in torchvision, not in timm)"
