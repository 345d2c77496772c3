"Data for `accum-finetune`: the embedded digits transfer task (no download) and checked image folders"
from __future__ import annotations
import sys
from pathlib import Path

import numpy as np
import torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader

__all__ = ['DataError', 'DIGITS_PRETRAIN', 'DIGITS_FINETUNE', 'SPLIT_DIRS', 'digits_tensors', 'digits_dls',
           'check_folder', 'folder_dls']

DIGITS_PRETRAIN,DIGITS_FINETUNE = (0,1,2,3,4),(5,6,7,8,9)   # pretrain on one half of the classes, transfer to the other
IMAGE_EXTS = {'.png', '.jpg', '.jpeg', '.bmp', '.gif', '.tif', '.tiff', '.webp'}

class DataError(ValueError):
    "Bad `--data`: the message names the path and the problem, and is shown to the user as one line"

def digits_tensors(classes=DIGITS_FINETUNE, size:int=32):
    "scikit-learn's bundled 8x8 handwritten digits of `classes`, upscaled to `size`x`size`, 3 channels, normalised"
    from sklearn.datasets import load_digits
    d = load_digits()
    keep = np.isin(d.target, classes)
    x = torch.tensor(d.images[keep], dtype=torch.float32)[:,None]/16.          # pixel values are 0..16
    x = F.interpolate(x, size=(size,size), mode='bilinear', align_corners=False)
    x = ((x-0.5)/0.5).expand(-1,3,-1,-1).contiguous()   # 3 channels, so any RGB architecture takes it
    # labels 0..len(classes)-1
    y = torch.as_tensor(np.searchsorted(np.array(classes), d.target[keep]), dtype=torch.long)
    return x,y

class DigitsDataset(TensorDataset):
    "The embedded images and labels; `Learner.export` can empty it (fastai calls `dataset.new_empty()`)"
    def new_empty(self): return type(self)(*[t[:0] for t in self.tensors])

def _split(n:int, valid_pct:float, seed:int):
    "Random train/valid index split, the same for a given `seed`"
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_valid = int(round(n*valid_pct))
    return idx[n_valid:],idx[:n_valid]

def _as_image(x):
    "A batch of images (N, C, H, W) as fastai's `TensorImage` (its batch augmentations dispatch on that type)"
    from fastai.torch_core import TensorImage
    return TensorImage(x) if isinstance(x, torch.Tensor) and x.ndim == 4 else x

def digits_dls(bs:int, classes=DIGITS_FINETUNE, size:int=32, valid_pct:float=0.2, seed:int=42, valid_bs:int=128,
               device='cpu',
               augment:bool=False):
    """`DataLoaders` of the embedded digits task (shuffled, last incomplete micro-batch dropped, like fastai's);
    `augment`: fastai's `aug_transforms` on the training batches, on the device, without flips or lighting (a small
    rotation, zoom and warp, a random-resized crop)"""
    x,y = digits_tensors(classes, size)
    tr,va = _split(len(y), valid_pct, seed)
    aug = {}
    if augment:
        from fastai.vision.augment import aug_transforms
        from fastai.data.core import Pipeline   # (fastcore.transform in fastai 2.7, fasttransform in 2.8)
        # no flips (a flipped digit is another digit, or none) and no lighting (fastai's works on [0, 1] pixels in logit
        # space, and these are already normalised to [-1, 1]: it made them nan and the accuracy 0.24)
        aug = dict(after_batch=Pipeline([_as_image, *aug_transforms(size=size, min_scale=0.75, do_flip=False,
                                                                    max_lighting=0.)],
                                        split_idx=0))
    train = DataLoader(DigitsDataset(x[tr], y[tr]), bs=bs, shuffle=True, drop_last=True, **aug)
    valid = DataLoader(DigitsDataset(x[va], y[va]), bs=valid_bs)
    dls = DataLoaders(train, valid, device=device)
    dls.vocab,dls.c = [str(c) for c in classes],len(classes)
    dls.source = (f"embedded digits {classes[0]}-{classes[-1]} (scikit-learn, 8x8 upscaled to {size}x{size}"
                  + (", augmented)" if augment else ")"))
    return dls

SPLIT_DIRS = ('train', 'valid')   # fastai's `from_folder` defaults

def image_exts()->set:
    """The extensions of the files fastai's `get_image_files` takes (every image type the system knows: .svg and .ico
    too), so that the folder check decodes every file training will read, not only the common ones (`IMAGE_EXTS`)"""
    from fastai.data.transforms import image_extensions
    return IMAGE_EXTS | set(image_extensions)

# what training writes into a Learner's `path` (fastai's `model_dir`, `Checkpoint`'s default and files): not classes
# (.part: a write cut short)
TRAINING_OUTPUTS,TRAINING_FILES = ('models', 'checkpoints'),('.pt', '.pth', '.pkl', '.part')

def _training_output(folder:Path)->bool:
    "A folder with no image that training wrote: `models/`, `checkpoints/`, or one holding only weights and checkpoints"
    files = [f for f in folder.rglob('*') if f.is_file()]
    return folder.name in TRAINING_OUTPUTS or (bool(files) and all(f.suffix in TRAINING_FILES for f in files))

def _class_images(path:Path, folder:Path, decode:bool=True)->dict:
    "`{class: [files]}` of the class sub-folders of `folder`, every image decoded once to check it (`decode`)"
    from PIL import Image
    classes = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith('.'))
    if not classes:
        raise DataError(f"--data {path}: {folder} has no class sub-folders (expected one sub-folder of images per "
                        "class)")
    found = {}
    for c in classes:
        files = sorted(f for f in c.rglob('*') if f.is_file() and f.suffix.lower() in image_exts())
        # a folder without images is no class, as in fastai's `from_folder` (which labels image files by their folder):
        # what fastai (`lr_find`, `learn.save`) or `Checkpoint` wrote there passed over silently, any other in one line
        if not files:
            if not _training_output(c): print(f"accum-finetune: --data {path}: {c} holds no image files: passed over, "
                                              "not a class (as fastai's from_folder does)", file=sys.stderr)
            continue
        for f in (files if decode else ()):
            try:
                with Image.open(f) as im: im.load()   # decode it all: `verify()` misses truncated files
            except Exception as e:
                raise DataError(f"--data {path}: cannot read image {f} ({type(e).__name__})") from None
        found[c.name] = files
    if not found:
        raise DataError(f"--data {path}: no sub-folder of {folder} holds images (expected one sub-folder of images per "
                        "class)")
    return found

def check_folder(path, decode:bool=True)->dict:
    """Check an image folder in either of `ImageDataLoaders.from_folder`'s layouts and return `{split: {class:
    [files]}}`: `train/` + `valid/`, each with one sub-folder of images per class (split `train` and `valid`), or one
    sub-folder of images per class (split `all`, divided at random by `folder_dls`). `decode`: decode every image to
    check it (the decode cache does that as it builds, so with a cache the layout alone is checked here)"""
    path = Path(path)
    if not path.exists():  raise DataError(f"--data {path}: no such folder")
    if not path.is_dir():  raise DataError(f"--data {path}: not a folder")
    subs = {p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith('.')}
    if not subs:
        raise DataError(f"--data {path}: empty (expected one sub-folder of images per class, or train/ and valid/)")
    if set(SPLIT_DIRS) <= subs:
        found = {s: _class_images(path, path/s, decode) for s in SPLIT_DIRS}
        extra = set(found['valid']) - set(found['train'])
        if extra: raise DataError(f"--data {path}: valid/ has classes that train/ lacks: {', '.join(sorted(extra))}")
        if len(found['train']) < 2: raise DataError(f"--data {path}: train/ has only one class folder; need at least 2")
        return found
    if subs & set(SPLIT_DIRS):
        have = (subs & set(SPLIT_DIRS)).pop()
        raise DataError(f"--data {path}: has {have}/ but not {({*SPLIT_DIRS}-{have}).pop()}/: give both (each with one "
                        f"sub-folder per class), or one sub-folder per class and no {have}/")
    found = _class_images(path, path, decode)
    if len(found) < 2: raise DataError(f"--data {path}: only one class folder ({next(iter(found))}); need at least 2")
    return {'all': found}

def _unreadable(path):
    "The error for an image the decode cache cannot read (the same words as the check's)"
    return lambda f, e: DataError(f"--data {path}: cannot read image {f} ({type(e).__name__})")

def folder_dls(path, bs:int, size:int=32, valid_pct:float=0.2, seed:int=42, valid_bs:int=128, files:dict|None=None,
               device='cpu', cache=None, augment:bool=False):
    """`DataLoaders` of a checked image folder (`files`: `check_folder(path)`, if made already), split and labelled as
    fastai's `ImageDataLoaders.from_folder` does (train/ + valid/ as given, otherwise `valid_pct` at random), at `size`,
    `augment`ed in training with fastai's `aug_transforms` and ImageNet-normalised, both on `device`.

    `cache`: a folder for the decode cache (`accum_finetune.cache`: every image decoded once, ever; batches read whole
    from memory-mapped uint8 arrays), or None for fastai's own pipeline (every image decoded in every epoch; on a GPU in
    worker processes into pinned memory)."""
    path = Path(path)
    files = check_folder(path, decode=cache is None) if files is None else files
    split = 'all' not in files
    n_tr = sum(len(v) for v in files['train' if split else 'all'].values())
    n_va = sum(len(v) for v in files['valid'].values()) if split else int(round(n_tr*valid_pct))
    if not split: n_tr -= n_va
    if n_va < 1 or n_tr < bs:
        raise DataError(f"--data {path}: {n_tr} training and {n_va} validation images are too few for "
                        + ("" if split else f"--valid-pct {valid_pct} and ") + f"a loader batch of {bs} (--loader-bs)")
    if cache is not None:
        from .cache import cached_dls, split_items
        train,valid,vocab = split_items(path, valid_pct, seed)
        dls = cached_dls(train, valid, vocab, size, bs, cache, _unreadable(path), augment=augment, valid_bs=valid_bs,
                         device=device, data=path)
    else:
        from fastai.vision.data import ImageDataLoaders
        from fastai.vision.augment import Resize
        import os
        cuda = torch.device(device).type == 'cuda'
        from fastai.data.transforms import Normalize
        from fastai.vision.augment import aug_transforms
        from fastai.vision.core import imagenet_stats
        tfms = [*(aug_transforms(size=size, min_scale=0.75) if augment else []), Normalize.from_stats(*imagenet_stats)]
        kw = dict(item_tfms=Resize(size), bs=bs, val_bs=valid_bs, batch_tfms=tfms,
                  num_workers=min(8, os.cpu_count() or 1) if cuda else 0, pin_memory=cuda, device=device)
        if split: dls = ImageDataLoaders.from_folder(path, train='train', valid='valid', seed=seed, **kw)
        else: dls = ImageDataLoaders.from_folder(path, valid_pct=valid_pct, seed=seed, **kw)
    n_cls = len(files['train' if split else 'all'])
    dls.source = (f"{path} ({n_cls} classes, " + (f"train/ {n_tr} + valid/ {n_va}" if split else f"{n_tr+n_va}") +
                  f" images, resized to {size}x{size}" + (", augmented" if augment else "") + ")")
    dls.inference = (list(dls.vocab), size)   # what `learn.export` keeps to predict from image files
    return dls
