"""A checkpoint's model and optimizer state through `torch.distributed.checkpoint` (DCP), for a `global_window` run
under FSDP2: each rank writes its own shards, and a resumed run reads the slices its own layout needs, on
any number of processes (on one: whole tensors, no process group). Everything else (the place, the RNGs, the
callbacks) stays in the rank files `Checkpoint` writes; they hold this folder's name and, in rank 0's, the length and
CRC-32 of each of its files (checked before it is read: a cut or damaged folder is passed over like a damaged file).

Read without running code: DCP's metadata file is a pickle, read here by an unpickler that makes DCP's own metadata
classes and nothing else, and only tensors are written (DCP reads other items with `torch.load(weights_only=False)`:
metadata that declares one is refused); DCP reads the tensors with `torch.load(weights_only=True)`. Written into a
`.part` folder that is renamed when every rank has written, so a cut save leaves no folder a resume would read."""
from __future__ import annotations
import io, pickle, shutil, zlib
from pathlib import Path

import torch
import torch.distributed as dist

from .format import CheckpointError, UnsafeCheckpoint, read_checkpoint
from ..core.distributed import is_fsdp, process_count, process_rank, unwrap
from .world_size import is_elastic

__all__ = ['writes_sharded', 'sharded_state', 'save_sharded', 'read_whole', 'check_sharded', 'load_sharded',
           'remove_sharded',
           'read_dcp_metadata']

_META = 'torch.distributed.checkpoint.metadata'
_ALLOWED = {(_META, n) for n in ('Metadata', 'MetadataIndex', 'StorageMeta', 'TensorProperties',
                                 'TensorStorageMetadata', 'BytesStorageMetadata',
                                 'ChunkStorageMetadata', '_MEM_FORMAT_ENCODING')}
_ALLOWED |= {('torch.distributed.checkpoint.filesystem', '_StorageInfo'), ('torch', 'Size'),
             ('torch.serialization', '_get_layout'), ('collections', 'OrderedDict')}
_ALLOWED |= {(m, c) for m in ('pathlib', 'pathlib._local')
             for c in ('PosixPath', 'WindowsPath', 'PurePosixPath', 'PureWindowsPath')}

class _MetadataUnpickler(pickle.Unpickler):
    "Makes DCP's metadata classes, torch's dtypes and sizes, paths: any other name is refused before anything runs"
    def find_class(self, module, name):
        if (module, name) in _ALLOWED: return super().find_class(module, name)
        if module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype): return getattr(torch, name)
        raise UnsafeCheckpoint(f"refused, not read: it names {module}.{name}, which is not DCP's metadata and would "
                               "run as code")

def read_dcp_metadata(path)->object:
    "DCP's metadata file at `path`, read by `_MetadataUnpickler`; `UnsafeCheckpoint` for anything but tensors' metadata"
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    try: md = _MetadataUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except UnsafeCheckpoint as e: raise UnsafeCheckpoint(f"{path}: {e}") from None
    except Exception as e: raise CheckpointError(f"{path}: damaged ({type(e).__name__}: {e})") from None
    if type(md) is not Metadata:
        raise UnsafeCheckpoint(f"{path}: refused: it holds a {type(md).__name__}, not DCP's metadata")
    if not isinstance(getattr(md, 'state_dict_metadata', None), dict):
        raise CheckpointError(f"{path}: damaged (its state_dict_metadata is a "
                              f"{type(getattr(md, 'state_dict_metadata', None)).__name__}, not a dict)")
    other = [k for k,v in md.state_dict_metadata.items() if type(v) is not TensorStorageMetadata]
    if other:
        raise UnsafeCheckpoint(f"{path}: refused: it declares {other[0]!r} as other than a tensor (DCP would unpickle "
                               "it, running code)")
    return md

def _reader(folder:Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    class SafeReader(FileSystemReader):
        "DCP's file reader, its metadata read by `read_dcp_metadata`"
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get('rank')
            md = read_dcp_metadata(Path(folder)/('.metadata' if rank is None else f'__{rank}.metadata'))
            if getattr(md, 'storage_meta', None) is None: md.storage_meta = StorageMeta()
            if hasattr(self, 'load_id'): md.storage_meta.load_id = self.load_id
            return md
    return SafeReader(folder)

def writes_sharded(model, elastic:bool)->bool:
    "Does this run's checkpoint put its model and optimizer in DCP?"; return elastic and is_fsdp(model)

def sharded_state(ckpt, st:dict, ga)->dict:
    """The state `ckpt` (a `Checkpoint`; `ga` its `GradientAccumulation`) writes in its rank file: as it is, or under
    FSDP2 in a `global_window` run without the model and optimizer, which go to the folder `ckpt-<serial>.dcp` (every
    rank writes its shards)"""
    learn = ckpt.learn
    if not writes_sharded(learn.model, is_elastic(ga)): return st
    try: man = save_sharded(ckpt.folder/f'ckpt-{ckpt.serial:06d}.dcp', learn.model, learn.opt)
    except CheckpointError: raise
    except Exception as e: raise OSError(f"DCP could not write the model: {type(e).__name__}: {e}") from e
    return strip_sharded(st, man)

def read_whole(f:Path, ckpt_folder:Path)->dict:
    """The rank file `f`, checked, and the DCP folder it names (this rank checks that its files are there, rank 0 that
    they are whole)"""
    st = read_checkpoint(f)
    if st.get('sharded'): check_sharded(ckpt_folder, st['sharded'], whole=process_rank() == 0)
    return st

def _tensors(model, opt)->tuple[dict, list]:
    """The tensors DCP holds, by name: the model's state and the optimizer's sharded (DTensor) states; and the latter's
    (index, name)"""
    state = {f'model/{k}': v for k,v in unwrap(model).state_dict().items()}
    keys = []
    if opt is not None:
        for i,(p,*_) in enumerate(opt.all_params(with_grad=False)):
            for name,v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and hasattr(v, 'device_mesh'):
                    state[f'opt/{i}/{name}'] = v
                    keys.append((i, name))
    return state,keys

def _crc(f:Path)->tuple[int,int]:
    data = f.read_bytes(); return zlib.crc32(data),len(data)

def save_sharded(folder:Path, model, opt)->dict:
    """Write the model's state and the optimizer's sharded states to the DCP folder `folder` (a collective: every rank
    calls it); returns what the rank files hold of it: the folder's name, the names, and (rank 0) each file's CRC-32"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    state,keys = _tensors(model, opt)
    part,rank,world = folder.with_name(folder.name + '.part'),process_rank(),process_count()
    if rank == 0: shutil.rmtree(part, ignore_errors=True)
    if world > 1: dist.barrier()
    dcp.save(state, storage_writer=FileSystemWriter(part, single_file_per_rank=True, thread_count=1))
    own = sorted(part.glob(f'__{rank}_*.distcp'))
    if len(own) > 1 or (own and own[0].name != f'__{rank}_0.distcp'):
        raise CheckpointError(f"DCP wrote {[f.name for f in own]} for rank {rank} in {part}, one file "
                              f"__{rank}_0.distcp was asked")
    sums = torch.zeros(world, 2, dtype=torch.int64)
    if own: sums[rank] = torch.tensor(_crc(own[0]))
    else: sums[rank] = -1
    if world > 1: dist.all_reduce(sums)
    files = {f'__{r}_0.distcp': tuple(sums[r].tolist()) for r in range(world) if sums[r, 0] >= 0}
    if rank == 0:
        files['.metadata'] = _crc(part/'.metadata')
        shutil.rmtree(folder, ignore_errors=True); part.rename(folder)
    if world > 1: dist.barrier()
    return dict(dir=folder.name, model=[k[len('model/'):] for k in state if k.startswith('model/')], opt=keys,
                files=files)

def check_sharded(ckpt_folder:Path, manifest:dict, whole:bool=True):
    "`CheckpointError` if the DCP folder `manifest` names is missing, or (`whole`) a file of it is cut or damaged"
    d = Path(ckpt_folder)/manifest['dir']
    for name,(crc,n) in manifest.get('files', {}).items():
        f = d/name
        if not f.is_file(): raise CheckpointError(f"{f}: missing")
        if whole and _crc(f) != (crc, n): raise CheckpointError(f"{f}: cut short or damaged (length or CRC-32 differs)")
    read_dcp_metadata(d/'.metadata')   # (refused here, before DCP reads it)

def load_sharded(ckpt_folder:Path, st:dict, model, opt)->dict:
    """The checkpoint `st` (a rank file's state) with the model's state loaded in place from its DCP folder, in this
    world's layout (FSDP2's shards on any number of processes, or whole tensors), and the optimizer's sharded states put
    back in `st['opt']`"""
    import torch.distributed.checkpoint as dcp
    man = st['sharded']
    sd = unwrap(model).state_dict()
    missing = [k for k in man['model'] if k not in sd]
    if missing:
        raise CheckpointError(f"Checkpoint: {ckpt_folder/man['dir']} holds {missing[0]!r}, which this model has not")
    state = {f'model/{k}': sd[k] for k in man['model']}
    params = [p for p,*_ in opt.all_params(with_grad=False)] if opt is not None else []
    for i,name in man['opt']: state[f'opt/{i}/{name}'] = torch.zeros_like(params[i])
    dcp.load(state, storage_reader=_reader(Path(ckpt_folder)/man['dir']))
    with torch.no_grad():   # (in place; copied again where DCP made new tensors)
        for k in man['model']:
            if state[f'model/{k}'] is not sd[k]: sd[k].copy_(state[f'model/{k}'])
    if st.get('opt') is not None:
        for i,name in man['opt']: st['opt']['state'][i][name] = state[f'opt/{i}/{name}']
    return st

def strip_sharded(st:dict, manifest:dict)->dict:
    """The rank file's state (taken without the model and gradients: `Checkpoint._snapshot` leaves them out where this
    folder holds them, and the window is empty) without the optimizer's sharded states, and naming the folder"""
    opt = st['opt']
    if opt is not None:
        drop = set(map(tuple, manifest['opt']))
        opt = dict(opt, state=[{k: v for k,v in s.items() if (i, k) not in drop} for i,s in enumerate(opt['state'])])
    return dict(st, opt=opt, sharded=manifest)

def remove_sharded(ckpt_folder:Path, name:str):
    "Rank 0 removes an old checkpoint's DCP folder"
    if process_rank() == 0: shutil.rmtree(Path(ckpt_folder)/name, ignore_errors=True)
