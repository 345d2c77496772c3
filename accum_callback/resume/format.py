"""The checkpoint file: how `Checkpoint` writes the state of a fit and reads it back without running code. The state is
written as plain types (tensors, numbers, strings, bytes, lists, tuples, dicts), the few others it holds as tagged
dicts made again from a fixed table on reading, and read with `torch.load(weights_only=True)`; the file carries a magic
line, its length and a CRC-32 (against cuts and damage only: anyone can compute them) and is written atomically."""
from __future__ import annotations
import collections, enum, io, json, math, os, pickle, struct, zlib
from pathlib import Path

import numpy as np
import torch
from fastcore.foundation import L

from ..core.files import atomic_write

__all__ = ['Plain', 'AsJson', 'json_normal', 'MAGIC', 'CheckpointError', 'UnsafeCheckpoint', 'read_checkpoint',
           'write_checkpoint', 'plain_state', 'packed_state', 'from_plain', 'reshard',
           'is_rank_shard']

MAGIC = b'ACKPT1\n'   # a checkpoint file's first line
_MAGIC = MAGIC   # (its name before 0.3: imported by tests and scripts)

class CheckpointError(ValueError):
    "A checkpoint that cannot be resumed exactly (what changed is named), or a damaged one"

class UnsafeCheckpoint(CheckpointError):
    "A checkpoint file that would run code when read (a planted or foreign pickle): never loaded"

# -- what a checkpoint may hold: read back with `torch.load(weights_only=True)`, so that a file runs no code
# ------------
# Tensors, numbers, strings, bytes and plain containers go as they are; the few other types the state holds are
# written as tagged plain dicts and made again on reading: numpy arrays (numpy's RNG state) and scalars, fastcore's `L`.
# The package's own state is plain already (each piece's `state_dict()`: the window's phase as its value).
_TAG = '__accum_callback__'

_PLAIN = (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)

def json_normal(o):
    """`o` as JSON gives it back (tuples as lists, keys as strings, other objects as their `repr`): how an `AsJson`
    value reads"""
    return json.loads(json.dumps(o, default=repr))

class AsJson:
    """A value of plain numbers, strings, lists and dicts written as one JSON text (one object to pickle, not hundreds:
    a fit's signature, in every checkpoint), read back as `json_normal` gives it"""
    def __init__(self, value): self.value = value

class _Unplain(Exception):
    "What cannot be written (a message with `{}` for where it is), and the keys down to it, added on the way back up"
    def __init__(self, what:str): self.what,self.keys = what,[]

def plain_state(o, where:str='state', copy:bool=False, _small:list|None=None):
    """`o` as types `torch.load(weights_only=True)` reads; `CheckpointError` naming what cannot be. `copy`: every tensor
    copied (a state written in the background while training changes the tensors it was taken from). (`_small`: where
    `packed_state` collects the small tensors)"""
    try: return _plain(o, copy, _small)
    except _Unplain as e: raise CheckpointError(e.what.format(where + ''.join(reversed(e.keys)))) from None

# Pickling a tensor costs torch.save about 20 objects, each through its Python `persistent_id`; a fit's state holds
# dozens of small ones (biases, norms, their moments and gradients, the RNG states): written one by one they were 60% of
# the pickling of a small model's checkpoint. Those of at most 16 KiB (on the CPU, contiguous, of a plain numeric dtype)
# go into one flat tensor per dtype; read back, each is a copy of its part (the pack is small: so is the peak it adds).
_PACKED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8,
           torch.uint8, torch.bool)   # (a file's index names them by their place here: the order is the format's)
_PACKED_NAMES = [str(d).removeprefix('torch.') for d in _PACKED]   # (the keys of a file's flat tensors)
_PACKED_BY_NAME = dict(zip(_PACKED_NAMES, _PACKED))
_PACK_BYTES = 1 << 14

def packed_state(o, where:str='state')->dict:
    """`o` as `plain_state(o, copy=True)` gives it, with its small tensors copied into one flat tensor per dtype: what a
    checkpoint file holds. `{TAG: 'pack', 'value': the state with each small tensor as {TAG: 'packed', 'i': n},
    'data': {dtype's name: flat tensor}, 'index': int64 rows [dtype's place in _PACKED, offset, ndim, *shape]}`"""
    small = []
    value = plain_state(o, where, True, small)
    if not small: return value
    groups,ends,rows,width = {},{},[],3 + max(t.ndim for t in small)
    for t in small:
        code = _PACKED.index(t.dtype)
        rows.append([code, ends.get(code, 0), t.ndim, *t.shape] + [0]*(width - 3 - t.ndim))
        groups.setdefault(code, []).append(t.reshape(-1)); ends[code] = rows[-1][1] + t.numel()
    data = {_PACKED_NAMES[code]: torch.cat(g) for code,g in groups.items()}   # (the copy of every small tensor)
    return {_TAG: 'pack', 'value': value, 'data': data, 'index': torch.tensor(rows, dtype=torch.int64)}

def _unpack(o:dict)->tuple:
    """A packed file's state and its small tensors, each copied out of its dtype's flat tensor; `CheckpointError` for a
    malformed pack"""
    data,index = _field(o, 'data', dict, 'pack'),_field(o, 'index', torch.Tensor, 'pack')
    for name,flat in data.items():
        if not (isinstance(flat, torch.Tensor) and flat.dtype == _PACKED_BY_NAME.get(name) and flat.ndim == 1):
            raise CheckpointError(f"a checkpoint's pack holds a malformed {name!r} ({type(flat).__name__})")
    if index.dtype != torch.int64 or index.ndim != 2 or index.shape[1] < 3:
        raise CheckpointError(f"a checkpoint's pack index is malformed ({index.dtype}, shape {tuple(index.shape)})")
    out = []
    for code,off,nd,*dims in index.tolist():
        flat,shape = data.get(_PACKED_NAMES[code]) if 0 <= code < len(_PACKED) else None,dims[:nd]
        if (flat is None or not 0 <= nd <= len(dims) or min(shape, default=0) < 0 or off < 0
            or (end := off + math.prod(shape)) > len(flat)):
            raise CheckpointError(f"a checkpoint's pack index has a malformed row {[code, off, nd, *dims]} (a shape or "
                                  "place outside its data)")
        out.append(flat[off:end].view(shape).clone())   # (a tensor of its own: torch's RNG takes a view's
    # storage from its start; small, so the peak stays)
    return _field(o, 'value', dict, 'pack'),out

def _copied(v, copy:bool, small):
    "A tensor as written: into the pack (`small`, a list) where it is small, else itself (copied: `copy`)"
    if (small is not None and v.device.type == 'cpu' and v.dtype in _PACKED and v.nbytes <= _PACK_BYTES
        and v.is_contiguous()):
        small.append(v); return {_TAG: 'packed', 'i': len(small) - 1}
    return v.clone() if copy else v

def _plain(o, copy:bool, small=None):
    "`plain_state`, without the path of keys (one string a value is not built: a checkpoint a step holds thousands)"
    t = type(o)
    if o is None or t in _PLAIN: return o
    if t is list or t is tuple:
        # (Python's RNG states, 625 ints; a long fit's logs and learning rates: one tensor, not an object each)
        if len(o) >= 64:
            if all(type(v) is int for v in o):
                try:
                    return {_TAG: 'ints', 'type': t.__name__,
                            'value': _copied(torch.tensor(o, dtype=torch.int64), False, small)}
                except (OverflowError, RuntimeError): pass   # (beyond int64: as they are)
            elif all(type(v) is float for v in o):
                return {_TAG: 'floats', 'type': t.__name__,
                        'value': _copied(torch.tensor(o, dtype=torch.float64), False, small)}
        out = []
        for i,v in enumerate(o):
            try: out.append(_plain(v, copy, small))
            except _Unplain as e: e.keys.append(f'[{i}]'); raise
        return t(out)
    if t is dict or t is collections.OrderedDict:
        if _TAG in o: raise _Unplain(f"Checkpoint: {{}} holds the key {_TAG!r}, which the checkpoint format reserves")
        out = t()
        for k,v in o.items():
            try: out[k] = _plain(v, copy, small)
            except _Unplain as e: e.keys.append(f'[{k!r}]'); raise
        return out
    if t is AsJson: return {_TAG: 'json', 'value': json.dumps(o.value, default=repr)}
    name = f'{t.__module__}.{t.__qualname__}'
    if isinstance(o, torch.Tensor):
        if t is torch.Tensor or t is torch.nn.Parameter: return _copied(o.detach(), copy, small)
        # a DTensor (FSDP2's optimizer state): this rank's shard,
        if hasattr(o, 'to_local') and hasattr(o, 'device_mesh'):
            # made a DTensor again like its parameter (`reshard`)
            v = o.to_local().detach()
            return {_TAG: 'shard', 'value': v.clone() if copy else v}
        # fastai's typed tensors (a batch read ahead: TensorImage, TensorCategory...): the data, and the type by name
        if _fastai_tensor(name) is None:
            raise _Unplain(f"Checkpoint: {{}} is a {name}, a tensor subclass a checkpoint read without running code "
                           "cannot hold: give a plain tensor")
        v = o.detach().as_subclass(torch.Tensor)
        return {_TAG: 'tensor', 'type': name, 'value': _copied(v, copy, small)}
    # (numbers as one tensor where they fit int64 or float64: numpy's RNG state is 624 of them)
    if isinstance(o, np.ndarray):
        fits = o.dtype.kind in 'bif' or (o.dtype.kind == 'u' and o.dtype.itemsize < 8)
        value = torch.from_numpy(o.astype(np.float64 if o.dtype.kind == 'f'
                                          else np.int64).ravel()) if fits else o.ravel().tolist()
        return {_TAG: 'ndarray', 'dtype': str(o.dtype), 'shape': list(o.shape),
                'value': _copied(value, False, small) if fits else value}
    if isinstance(o, np.generic): return o.item()
    if isinstance(o, L): return {_TAG: 'L', 'value': [_plain(v, copy, small) for v in o]}
    if isinstance(o, (bool, int, float, str)) and not isinstance(o, enum.Enum):   # a subclass: its plain value
        return next(t for t in (bool, int, float, str) if isinstance(o, t))(o)
    raise _Unplain(f"Checkpoint: {{}} holds a {name}, which a checkpoint read without running code cannot hold: give "
                   "numbers, strings, tensors, lists, tuples and dicts (a callback's `state_dict()` included)")

class _Shard(torch.Tensor):
    "A DTensor's local shard as read from a checkpoint, until `_reshard` makes it a DTensor like its parameter"

def is_rank_shard(t)->bool:
    "Is `t` a rank's shard of a DTensor as read from a checkpoint (made a DTensor again by `reshard`)?"
    return isinstance(t, _Shard)

def reshard(state, param):
    "The optimizer `state` of `param` (a dict, list or tensor) with every `_Shard` a DTensor laid out as `param`"
    if isinstance(state, _Shard):
        t = state.as_subclass(torch.Tensor)
        if not hasattr(param, 'device_mesh'): return t
        return type(param).from_local(t.to(param.to_local().device), param.device_mesh, param.placements,
                                      run_check=False, shape=param.shape, stride=param.stride())
    if isinstance(state, dict): return type(state)((k, reshard(v, param)) for k,v in state.items())
    if type(state) in (list, tuple): return type(state)(reshard(v, param) for v in state)
    return state

def _fastai_tensor(name):
    "fastai's tensor class of that full name (`fastai.torch_core.TensorBase` and its subclasses in fastai), or None"
    import sys
    from fastai.torch_core import TensorBase
    if not isinstance(name, str) or not name.startswith('fastai.'): return None
    mod,_,cls = name.rpartition('.')
    c = getattr(sys.modules.get(mod), cls, None)   # (a module fastai has loaded: nothing is imported by name)
    return c if isinstance(c, type) and issubclass(c, TensorBase) else None

# numpy dtypes a checkpoint may name: booleans and numbers (a 'U125000000' asked 400 MB of a 1.4 KB file)
_NUMERIC_KINDS = 'biufc'

def _field(o:dict, key:str, kind, what:str):
    "`o[key]` when it is a `kind`, else `CheckpointError` naming the tag"
    v = o.get(key)
    if not isinstance(v, kind):
        raise CheckpointError(f"a checkpoint's {what} holds a malformed {key!r} ({type(v).__name__})")
    return v

def _ndarray(o:dict):
    try: dt = np.dtype(_field(o, 'dtype', str, 'array'))
    except TypeError as e: raise CheckpointError(f"a checkpoint's array names an unknown dtype: {e}") from None
    if dt.kind not in _NUMERIC_KINDS or dt.itemsize > 16:
        raise CheckpointError(f"a checkpoint's array has dtype {dt.str!r}: only booleans and numbers are read")
    shape,value = _field(o, 'shape', list, 'array'),_field(o, 'value', (list, torch.Tensor), 'array')
    if isinstance(value, torch.Tensor):
        if value.ndim != 1 or value.dtype not in (torch.int64, torch.float64):
            raise CheckpointError(f"a checkpoint's array holds a {value.dtype} tensor of {value.ndim} dimensions")
        value = value.numpy()
    if not all(type(n) is int and n >= 0 for n in shape) or math.prod(shape) != len(value):
        raise CheckpointError(f"a checkpoint's array has shape {shape!r} for {len(value)} values")
    if isinstance(value, list) and not all(type(v) in (bool, int, float, complex) for v in value):
        raise CheckpointError("a checkpoint's array holds values other than numbers")
    # (numpy would wrap what does not fit, silently)
    if not isinstance(value, list) and len(value) and dt.kind in 'biu':
        lo,hi = (0, 1) if dt.kind == 'b' else (np.iinfo(dt).min, np.iinfo(dt).max)
        if value.dtype.kind != 'i' or value.min() < lo or value.max() > hi:
            raise CheckpointError(f"a checkpoint's array does not fit its dtype {dt.str!r}")
    try: return np.array(value, dtype=dt).reshape(shape)
    except (OverflowError, ValueError, TypeError) as e:
        raise CheckpointError(f"a checkpoint's array does not fit its dtype {dt.str!r}: {e}") from None

def from_plain(o, packed:list|None=None):
    """What `plain_state` wrote, made again; `CheckpointError` for a tag that is malformed (nothing else is made).
    `packed`: the small tensors of a packed file (`_unpack`), which its `{TAG: 'packed', 'i': n}` stand for"""
    if isinstance(o, dict):
        tag = o.get(_TAG)
        if tag is None: return type(o)((k, from_plain(v, packed)) for k,v in o.items())
        if tag == 'packed':
            i = o.get('i')
            if packed is None or type(i) is not int or not 0 <= i < len(packed) or len(o) != 2:
                raise CheckpointError(f"a checkpoint holds a packed tensor {i!r} that its pack does not have")
            return packed[i]
        if isinstance(v := o.get('value'), dict) and v.get(_TAG) == 'packed': o = dict(o, value=from_plain(v, packed))
        if tag == 'ndarray': return _ndarray(o)
        if tag == 'json':
            try: return json.loads(_field(o, 'value', str, "'json'"))
            except ValueError as e:
                raise CheckpointError(f"a checkpoint's JSON text is malformed: {str(e)[:100]}") from None
        if tag in ('ints', 'floats'):
            v,kind = _field(o, 'value', torch.Tensor, repr(tag)),{'tuple': tuple, 'list': list}.get(o.get('type'))
            if kind is None or v.ndim != 1 or v.dtype != (torch.int64 if tag == 'ints' else torch.float64):
                raise CheckpointError(f"a checkpoint's {tag!r} is malformed")
            return kind(v.tolist())
        if tag == 'L': return L([from_plain(v, packed) for v in _field(o, 'value', list, "'L'")])
        if tag == 'shard': return _field(o, 'value', torch.Tensor, 'shard').as_subclass(_Shard)
        if tag == 'tensor':
            cls = _fastai_tensor(o.get('type'))
            if cls is None:
                raise CheckpointError(f"a checkpoint names a tensor type that is not fastai's: {o.get('type')!r}")
            return _field(o, 'value', torch.Tensor, 'tensor').as_subclass(cls)
        raise CheckpointError(f"a checkpoint holds an unknown tag {tag!r}")
    if isinstance(o, (list, tuple)) and type(o) in (list, tuple): return type(o)(from_plain(v, packed) for v in o)
    return o

class Plain:
    """A state made plain already (`plain_state`, tensors copied), and the mode bits of its file: what a background
    write takes"""
    def __init__(self, value, perms:int|None=None): self.value,self.perms = value,perms

def write_checkpoint(path:Path, obj)->int:
    """Write `obj` (the state of a fit, or a `Plain` one) to `path` atomically, as plain types with the header; returns
    the bytes written"""
    plain = obj.value if isinstance(obj, Plain) else packed_state(obj)
    buf = io.BytesIO(); torch.save(plain, buf); data = buf.getvalue()
    with atomic_write(path, perms=getattr(obj, 'perms', None)) as f:
        f.write(MAGIC + struct.pack('<IQ', zlib.crc32(data), len(data)))
        f.write(data)
    return len(data)

def _unsupported(e)->str:
    "The line of torch's refusal that names what the file asked for"
    lines = [l.strip() for l in str(e).splitlines() if 'Unsupported' in l or 'WeightsUnpickler' in l]
    return (lines[0] if lines else str(e).splitlines()[0])[:240]

class _Past:
    "The file `f` from byte `h` on, as a file of its own (what `torch.load` reads: the checkpoint after its header)"
    def __init__(self, f, h:int): self.f,self.h = f,h
    def read(self, n:int=-1)->bytes: return self.f.read(n)
    def readinto(self, b)->int: return self.f.readinto(b)
    def readable(self)->bool: return True
    def seekable(self)->bool: return True
    def tell(self)->int: return self.f.tell() - self.h
    def seek(self, pos:int, whence:int=0)->int:
        return self.f.seek(pos + self.h if whence == 0 else pos, whence) - self.h

def read_checkpoint(path)->dict:
    """The contents of one checkpoint file, checked (its length and CRC-32); `CheckpointError` if it is cut or damaged.
    The CRC is computed reading the file in chunks, and `torch.load` reads the tensors from the file itself: the peak is
    the tensors, about the file's size (it was 3 times: the bytes, a copy, the tensors)"""
    h = len(MAGIC) + 12
    with open(path, 'rb') as f:
        head = f.read(h)
        if not head.startswith(MAGIC) or len(head) < h: raise CheckpointError(f"{path}: not a checkpoint, or cut short")
        crc,n = struct.unpack('<IQ', head[len(MAGIC):h])
        size = os.fstat(f.fileno()).st_size - h
        if size != n: raise CheckpointError(f"{path}: cut short or grown ({size} bytes after its header, of {n})")
        c = 0
        while chunk := f.read(1 << 22): c = zlib.crc32(chunk, c)
        if c != crc: raise CheckpointError(f"{path}: damaged (CRC-32 differs)")
        f.seek(h)
        try: st = torch.load(_Past(f, h), map_location='cpu', weights_only=True)   # (runs no code: see `_plain_state`)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(f"{path}: refused, not read: it holds objects other than tensors, numbers, strings "
                                   f"and containers, which loading would run as code ({_unsupported(e)})") from None
        except Exception as e: raise CheckpointError(f"{path}: damaged ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(st, dict): raise CheckpointError(f"{path}: holds a {type(st).__name__}, not the state of a fit")
    try:
        st,packed = _unpack(st) if st.get(_TAG) == 'pack' else (st, None)
        st = from_plain(st, packed)
        if not isinstance(st, dict): raise CheckpointError(f"holds a {type(st).__name__}, not the state of a fit")
        return st
    except CheckpointError as e: raise CheckpointError(f"{path}: {e}") from None
    except RecursionError: raise CheckpointError(f"{path}: nested too deep") from None

