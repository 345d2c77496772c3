"Data for `accum-finetune`: the embedded digits transfer task (no download) and checked image folders"
from __future__ import annotations
from pathlib import Path

import numpy as np
import torch, torch.nn.functional as F
from torch.utils.data import TensorDataset
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader

__all__ = ['DataError', 'DIGITS_PRETRAIN', 'DIGITS_FINETUNE', 'digits_tensors', 'digits_dls', 'check_folder', 'folder_dls']

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
    y = torch.as_tensor(np.searchsorted(np.array(classes), d.target[keep]), dtype=torch.long)  # labels 0..len(classes)-1
    return x,y

def _split(n:int, valid_pct:float, seed:int):
    "Random train/valid index split, the same for a given `seed`"
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_valid = int(round(n*valid_pct))
    return idx[n_valid:],idx[:n_valid]

def digits_dls(bs:int, classes=DIGITS_FINETUNE, size:int=32, valid_pct:float=0.2, seed:int=42, valid_bs:int=128):
    "`DataLoaders` of the embedded digits task (shuffled, last incomplete micro-batch dropped, like fastai's)"
    x,y = digits_tensors(classes, size)
    tr,va = _split(len(y), valid_pct, seed)
    train = DataLoader(TensorDataset(x[tr], y[tr]), bs=bs, shuffle=True, drop_last=True)
    valid = DataLoader(TensorDataset(x[va], y[va]), bs=valid_bs)
    dls = DataLoaders(train, valid, device='cpu')
    dls.vocab,dls.c = [str(c) for c in classes],len(classes)
    dls.source = f"embedded digits {classes[0]}-{classes[-1]} (scikit-learn, 8x8 upscaled to {size}x{size})"
    return dls

def check_folder(path)->dict:
    "Check an `ImageDataLoaders.from_folder` folder (one sub-folder of images per class); return `{class: [files]}`"
    from PIL import Image
    path = Path(path)
    if not path.exists():  raise DataError(f"--data {path}: no such folder")
    if not path.is_dir():  raise DataError(f"--data {path}: not a folder")
    classes = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith('.'))
    if not classes: raise DataError(f"--data {path}: empty (expected one sub-folder of images per class)")
    if len(classes) < 2: raise DataError(f"--data {path}: only one class folder ({classes[0].name}); need at least 2")
    found = {}
    for c in classes:
        files = sorted(f for f in c.rglob('*') if f.is_file() and f.suffix.lower() in IMAGE_EXTS)
        if not files: raise DataError(f"--data {path}: class folder {c} has no images")
        for f in files:
            try:
                with Image.open(f) as im: im.load()   # decode it all: `verify()` misses truncated files
            except Exception as e: raise DataError(f"--data {path}: cannot read image {f} ({type(e).__name__})") from None
        found[c.name] = files
    return found

def folder_dls(path, bs:int, size:int=32, valid_pct:float=0.2, seed:int=42, valid_bs:int=128, files:dict|None=None):
    "`ImageDataLoaders.from_folder` of a checked folder, resized to `size`, ImageNet-normalised (`files`: `check_folder(path)`, if made already)"
    from fastai.vision.data import ImageDataLoaders, imagenet_stats
    from fastai.vision.augment import Resize
    from fastai.data.transforms import Normalize
    files = check_folder(path) if files is None else files   # decoding every image once is enough
    n = sum(len(v) for v in files.values())
    n_valid = int(round(n*valid_pct))
    if n_valid < 1 or n-n_valid < bs:
        raise DataError(f"--data {path}: {n} images are too few for --valid-pct {valid_pct} and --micro-bs {bs}")
    dls = ImageDataLoaders.from_folder(path, valid_pct=valid_pct, seed=seed, item_tfms=Resize(size), bs=bs,
                                       val_bs=valid_bs, batch_tfms=Normalize.from_stats(*imagenet_stats),
                                       num_workers=0, device='cpu')
    dls.source = f"{path} ({len(files)} classes, {n} images, resized to {size}x{size})"
    return dls
