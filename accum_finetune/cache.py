"""Decode once: an image folder's pixels, each resized once to the job's working size (with a margin for random crops in
training) and kept in a memory-mapped uint8 array per split, in the job's cache folder; and the loader that serves whole
batches of them, with fastai's augmentation and normalisation done on the device the model is on.

The cache of a split is keyed by its files (paths, sizes, modification times), the size and this module's version: a
second run on the same folder decodes nothing, a changed, added or removed file builds it again (the stale one goes).
It is written to a temporary name and renamed when complete, so an interrupted run leaves nothing that is ever read; a
corrupt image is one clear error naming the file, with nothing of that cache left behind."""
from __future__ import annotations
import hashlib, json, math, os, socket, tempfile, zlib
from pathlib import Path

import numpy as np
import torch

from accum_callback.core.files import replace_durably

__all__ = ['CACHE_VERSION', 'MARGIN', 'CacheError', 'split_items', 'decode', 'cached_split', 'CachedImages',
           'cached_dls',
           'inference_dls']

CACHE_VERSION = 2   # 2: stored (N, 3, H, W)
MARGIN = 8/7   # training images are cached this much larger (224 -> 256), for the random-resized crop to the size

def split_items(path:Path, valid_pct:float, seed:int)->tuple[list,list,list]:
    """(train files, valid files, vocab) exactly as fastai's `ImageDataLoaders.from_folder` splits and labels the folder
    (its own functions: `get_image_files`, `RandomSplitter`/`GrandparentSplitter`, `parent_label`, the training labels'
    sorted vocabulary), without decoding an image"""
    from fastai.data.transforms import get_image_files, RandomSplitter, GrandparentSplitter, parent_label, CategoryMap
    split = (path/'train').is_dir() and (path/'valid').is_dir()
    items = get_image_files(path, folders=['train', 'valid']) if split else get_image_files(path)
    tr,va = (GrandparentSplitter('train', 'valid') if split else RandomSplitter(valid_pct, seed=seed))(items)
    train,valid = [items[i] for i in tr],[items[i] for i in va]
    return train,valid,list(CategoryMap([parent_label(f) for f in train]))

def decode(f:Path, size:int)->np.ndarray:
    """One image file as fastai's validation pipeline sees it: `PILImage.create`, `Resize(size)` (centre), RGB uint8 (H,
    W, 3)"""
    from fastai.vision.core import PILImage
    from fastai.vision.augment import Resize
    return np.asarray(Resize(size)(PILImage.create(f), split_idx=1).convert('RGB'))

def _key(files:list, size:int)->str:
    # a file's change time too: an image replaced by one of the same size and modification time is still noticed
    h = hashlib.sha256(json.dumps([CACHE_VERSION, size] + [(str(Path(f).resolve()),
                                                            *(lambda s: (s.st_size, s.st_mtime_ns,
                                                                         s.st_ctime_ns))(os.stat(f)))
                                                          for f in files]).encode())
    return h.hexdigest()[:16]

class CacheError(OSError):
    "The cache folder cannot be used (not a folder, read-only, full): the job says so in one line (exit 2)"

def _usable_folder(folder:Path)->Path:
    "`folder`, created if need be, or a `CacheError` saying why it cannot hold the cache and what to do"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK): raise PermissionError(13, 'not writable')
    except OSError as e:
        why = 'it is a file' if isinstance(e, FileExistsError) or (folder.exists() and not folder.is_dir()) else \
              'a parent is a file' if isinstance(e, NotADirectoryError) else (e.strerror or type(e).__name__).lower()
        raise CacheError(f"--cache {folder}: cannot keep the decoded images there ({why}): give another folder, or "
                         "--cache off (decode every image in every epoch)") from None
    return folder

STALE_OTHER_HOST_S = 24*3600   # a half-written cache of another machine (a shared cache folder) is removed after this

def _part_owner(p:Path)->tuple[int|None,str|None]:
    "(pid, host) of a half-written cache `.NAME-PID@HOST-XXXX.npy.part` (0.2.0's `.NAME-PID-XXXX`: this host's)"
    stem = p.name.split('.npy.part')[0].rsplit('-', 1)[0]   # (mkstemp's random part has no '-')
    who,host = stem.rsplit('@', 1) if '@' in stem else (stem, socket.gethostname())
    try: return int(who.rsplit('-', 1)[1]),host
    except (ValueError, IndexError): return None,None

def _stale_parts(folder:Path):
    """Half-written caches (`.NAME-PID@HOST-*.npy.part`) of processes that are gone (killed mid-build): removed. A
    builder on another machine sharing the folder cannot be asked whether it runs (its pid means nothing here): its
    part is removed only when untouched for `STALE_OTHER_HOST_S`"""
    import time
    here = socket.gethostname()
    for p in [*folder.glob('.*.npy.part'), *folder.glob('.*.npy.part.crc32')]:
        pid,host = _part_owner(p)
        if pid == os.getpid() and host == here: continue
        if pid is None: pass   # (not a name a builder gives: nothing of a live one)
        elif host == here:
            try: os.kill(pid, 0); continue   # its builder still runs
            except ProcessLookupError: pass
            except PermissionError: continue
        else:
            try:
                if time.time() - p.stat().st_mtime < STALE_OTHER_HOST_S: continue
            except OSError: continue
        p.unlink(missing_ok=True)

FULL_CHECK_BYTES = 256 << 20   # a cache up to this size is checked whole when opened; a larger one on a sample of rows
SAMPLE_ROWS = 1024

def _load(path:Path, n:int, size:int):
    """The cache at `path` memory-mapped, or None when it is damaged: its header or its length is not that of `n`
    images at `size` (a copy cut short, a rename never synced before a power loss), or a row's CRC-32, recorded beside
    it when built, does not match (bytes changed in place). Every row is checked up to `FULL_CHECK_BYTES` (about 1
    GB/s), `SAMPLE_ROWS` rows drawn at random above (docs/main_job.md: the limit)"""
    try:
        arr = np.load(path, mmap_mode='r')
        ok = arr.shape == (n, 3, size,
                           size) and arr.dtype == np.uint8 and path.stat().st_size == arr.offset + arr.nbytes
        crcs = np.loadtxt(_checksum_file(path), dtype=np.uint32, ndmin=1) if ok else None
    except (ValueError, OSError, EOFError): return None
    if not ok or len(crcs) != n: return None
    rows = range(n) if arr.nbytes <= FULL_CHECK_BYTES else np.random.default_rng().choice(n, min(n, SAMPLE_ROWS),
                                                                                          replace=False)
    if any(zlib.crc32(np.ascontiguousarray(arr[i]).data) != crcs[i] for i in rows): return None
    return arr

def _umask()->int:
    m = os.umask(0); os.umask(m); return m

def _checksum_file(path:Path)->Path: return path.with_suffix('.crc32')

def cached_split(files:list, size:int, folder:Path, name:str, error)->np.ndarray:
    """The images `files` at `size`, memory-mapped from `folder` (built first if the folder has none for exactly these
    files and size, or if the one there is damaged: rebuilt with one warning). `name` tells this split's cache from the
    others of the same data (its older versions are removed when a new one is built); `error(f, e)` makes the exception
    for a file that cannot be read. A folder that cannot hold it, or a disk that fills up while building, is a
    `CacheError`, with nothing half-written left behind"""
    folder = _usable_folder(Path(folder))
    path = folder/f'{name}-{size}px-{_key(files, size)}.npy'
    if path.is_file():
        arr = _load(path, len(files), size)
        if arr is not None: return arr
        import warnings
        warnings.warn(f"accum-finetune: the decode cache {path} is damaged (cut short or changed since it was built): "
                      "building it again", stacklevel=2)
        path.unlink(missing_ok=True)
    _stale_parts(folder)
    fd,tmp = tempfile.mkstemp(prefix=f'.{name}-{os.getpid()}@{socket.gethostname()}-', suffix='.npy.part', dir=folder)
    tmp = Path(tmp)
    try:
        # written with plain file writes, not a memory map: a full disk is an OSError here, not a SIGBUS later
        with os.fdopen(fd, 'wb') as f:
            np.lib.format.write_array_header_1_0(f, dict(descr='|u1', fortran_order=False,
                                                         shape=(len(files), 3, size, size)))
            crcs = []
            for f_ in files:
                try: row = np.ascontiguousarray(decode(f_, size).transpose(2, 0, 1))   # NCHW, as torch
                except Exception as e: raise error(f_, e) from None
                f.write(row.data); crcs.append(zlib.crc32(row.data))
        sums = tmp.with_name(tmp.name + '.crc32')
        sums.write_text('\n'.join(map(str, crcs)) + '\n')
        mode = 0o666 & ~_umask()   # readable by whoever the folder is shared with (mkstemp makes 0600)
        os.chmod(tmp, mode); os.chmod(sums, mode)
        replace_durably(sums, _checksum_file(path))
        replace_durably(tmp, path)   # complete: only now does it have the name that is read
    except OSError as e:
        raise CacheError(f"--cache {folder}: cannot write the decoded images ({e.strerror or e}): free space there, "
                         "give another folder, or --cache off") from None
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + '.crc32').unlink(missing_ok=True)
    for old in folder.glob(f'{name}-{size}px-*.npy'):   # the versions before (changed files): never read again
        if old != path: old.unlink(missing_ok=True); _checksum_file(old).unlink(missing_ok=True)
    return np.load(path, mmap_mode='r')

def _loader_class():
    from fastai.data.load import DataLoader
    from fastai.torch_core import TensorCategory, TensorImage

    class CachedImages(DataLoader):
        """fastai's `DataLoader` (its shuffling `rng`, `drop_last`, device moves and batch transforms) over cached
        images: its dataset is the range of indices, and a batch is read from the array in one indexing operation (no
        per-image decoding), as (B, 3, H, W) uint8, with its labels"""
        def __init__(self, images, labels, **kwargs):
            self.images,self.labels = images,np.asarray(labels, dtype=np.int64)
            kwargs.pop('dataset', None)   # (`new` passes it)
            super().__init__(dataset=range(len(self.labels)), **kwargs)   # an item is its index
        def create_batch(self, idxs):
            i = np.asarray(idxs)
            x = torch.from_numpy(self.images[i])   # (fancy indexing copies: a contiguous (B, 3, H, W) batch)
            return TensorImage(x),TensorCategory(torch.from_numpy(self.labels[i]))
        def new(self, dataset=None, cls=None, **kwargs):   # fastai's `new` re-creates with the same images and labels
            res = super().new(dataset, cls or type(self), images=self.images, labels=self.labels, **kwargs)
            return res
    return CachedImages

def __getattr__(name):   # `CachedImages` is built on first use: fastai loads only when the job runs
    if name == 'CachedImages': return _loader_class()
    raise AttributeError(name)

def _plain_transforms():
    """fastai's `IntToFloatTensor` and `Normalize` with the same arithmetic, in place on the batch as a plain tensor:
    the batch's two passes without fastai's typed-tensor dispatch on every op or a new tensor each (2.3x the images/s
    of fastai's pair on a 2-core CPU, bench/loader_bench.py; on a GPU both are one kernel each anyway)"""
    from fastai.data.core import Transform
    from fastai.torch_core import TensorImage

    # (no type annotations: fastai dispatches on them, resolved in module globals; the labels pass through)
    class ToFloat(Transform):
        "uint8 images to float in [0, 1], as fastai's `IntToFloatTensor`"
        order = 10
        def encodes(self, x):
            return TensorImage(x.as_subclass(torch.Tensor).float().div_(255.)) if isinstance(x, TensorImage) else x

    class Normalise(Transform):
        "(x - mean) / std per channel, as fastai's `Normalize`, in place"
        order = 99
        def __init__(self, mean, std): super().__init__(); self.mean,self.std = mean,std
        def _ms(self, t):
            return (torch.as_tensor(v, dtype=t.dtype, device=t.device).view(1, -1, 1, 1) for v in (self.mean, self.std))
        def encodes(self, x):
            if not isinstance(x, TensorImage): return x
            t = x.as_subclass(torch.Tensor); m,s = self._ms(t)
            return TensorImage(t.sub_(m).div_(s))
        def decodes(self, x):
            if not isinstance(x, TensorImage): return x
            t = x.as_subclass(torch.Tensor); m,s = self._ms(t)
            return TensorImage(t*s + m)
    return ToFloat,Normalise

def batch_tfms(size:int, augment:bool, train:bool)->list:
    """What runs on the device, on a batch: to float, fastai's `aug_transforms` in training (flips, a small rotation,
    zoom and warp, lighting, a random-resized crop to `size` of the larger cached image), ImageNet normalisation"""
    from fastai.vision.augment import aug_transforms
    from fastai.vision.core import imagenet_stats
    ToFloat,Normalise = _plain_transforms()
    return [ToFloat(), *(aug_transforms(size=size, min_scale=0.75) if augment and train else []),
            Normalise(*imagenet_stats)]

def cached_dls(train:list, valid:list, vocab:list, size:int, bs:int, folder:Path, error, augment:bool=True,
               valid_bs:int=128, device='cpu', data=None):
    """`DataLoaders` of the cached images of a split folder (`data`, which names its caches: a data folder's new cache
    replaces its old one, another folder's stays): the training images at `size` times `MARGIN` when `augment` (the
    random crop's room), else at `size`; the validation images at `size`"""
    from fastai.data.core import DataLoaders
    from fastai.data.core import Pipeline   # (fastcore.transform in fastai 2.7, fasttransform in 2.8)
    cls = _loader_class()
    lab = {v: i for i,v in enumerate(vocab)}
    ys = lambda fs: [lab[Path(f).parent.name] for f in fs]
    tsize = math.ceil(size*MARGIN) if augment else size
    tag = hashlib.sha256(str(Path(data or Path(train[0]).parent).resolve()).encode()).hexdigest()[:8]
    xt,xv = cached_split(train, tsize, folder, f'{tag}-train',
                         error),cached_split(valid, size, folder, f'{tag}-valid', error)
    cuda = torch.device(device).type == 'cuda'
    mk = lambda x, y, b, is_train: cls(x, y, bs=b, shuffle=is_train, drop_last=is_train, pin_memory=cuda, device=device,
                                       after_batch=Pipeline(batch_tfms(size, augment, is_train),
                                                            split_idx=0 if is_train else 1))
    dls = DataLoaders(mk(xt, ys(train), bs, True), mk(xv, ys(valid), valid_bs, False), device=device)
    dls.vocab,dls.c = vocab,len(vocab)
    return dls

def _x(o): return o['x'] if isinstance(o, dict) else o   # an image file (predict), or the stand-in below
def _y(o):
    from fastai.data.transforms import parent_label
    return o['y'] if isinstance(o, dict) else parent_label(o)
def _no_split(items): return list(range(len(items))),[]

def inference_dls(vocab:list, size:int, device='cpu', like=None):
    """fastai `DataLoaders` with the job's inference pipeline (an image file decoded, `Resize(size)`, ImageNet
    normalisation) and `vocab`: what `learn.export` keeps, so that `load_learner(...).predict(image_file)` works. fastai
    sets its pipeline up on one item: an image already decoded (`like`, e.g. a cached one), so no file is decoded
    here"""
    from fastai.data.block import CategoryBlock, DataBlock
    from fastai.data.transforms import Normalize
    from fastai.vision.augment import Resize
    from fastai.vision.core import imagenet_stats
    from fastai.vision.data import ImageBlock
    like = np.zeros((size, size, 3), np.uint8) if like is None else np.asarray(like)   # (H, W, 3), as PIL gives
    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock(vocab=list(vocab))), splitter=_no_split, get_x=_x, get_y=_y,
                       item_tfms=Resize(size), batch_tfms=Normalize.from_stats(*imagenet_stats))
    return dblock.dataloaders([dict(x=like, y=vocab[0])], bs=1, device=device, num_workers=0)
