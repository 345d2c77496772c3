"""Build a fastai `Learner` for the job (model, accumulation, BatchNorm mode, precision), fine-tune it, and report.
A library here sets no global state: threads and the plotting backend are the command line's business (`cli.py`)."""
from __future__ import annotations
import json, random, resource, time
from pathlib import Path

import torch
from fastai.callback.core import Callback
from fastai.learner import Learner
import fastai.callback.schedule, fastai.callback.progress   # noqa: F401  `fit_one_cycle`, progress bars
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.torch_core import find_bs, set_seed

from accum_callback import GradientAccumulation, BatchNormAccumulation
from accum_callback.micro import MicroBatching, micro_batching, n_pieces
from accum_callback.core.distributed import process_count
from .models import DEFAULT_ARCH, create_model, has_batchnorm, load_weights

__all__ = ['JOB_BN_MODES', 'PRECISIONS', 'resolve_device', 'describe_device', 'resolve_precision', 'auto_bn',
           'auto_precise',
           'precision_callbacks', 'build_learner', 'Throughput', 'finetune', 'plot_training', 'write_metrics']

from accum_callback.batchnorm.modes import BN_MODES
# the job's --bn: the library's modes, plus the measured choice and plain BN
JOB_BN_MODES = ('auto', 'none') + BN_MODES
PRECISIONS = ('auto', 'fp32', 'fp16', 'bf16')

# -- device and precision -----------------------------------------------------------------------------------------
def resolve_device(spec:str='auto')->torch.device:
    "`auto` (the GPU when there is one), `cpu`, `cuda` or `cuda:N`, checked against what this machine has"
    if spec == 'auto': return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    dev = torch.device(spec)
    if dev.type == 'cuda':
        if not torch.cuda.is_available():
            raise ValueError(f"{spec}: no CUDA device on this machine (use --device cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev

def describe_device(dev)->str:
    "'cpu', or 'cuda:0 NVIDIA H100 80GB HBM3'"
    dev = torch.device(dev)
    if dev.type != 'cuda': return dev.type
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    return f'cuda:{i} {torch.cuda.get_device_name(i)}'

def resolve_precision(spec:str, device)->str:
    """`auto`: bf16 on a GPU that supports it, else fp16 on CUDA, fp32 on the CPU; fp16/bf16 need CUDA (fastai's
    MixedPrecision)"""
    dev = torch.device(device)
    if spec == 'auto':
        if dev.type != 'cuda': return 'fp32'
        with torch.cuda.device(dev): return 'bf16' if torch.cuda.is_bf16_supported() else 'fp16'
    if spec != 'fp32' and dev.type != 'cuda':
        raise ValueError(f"{spec} trains through CUDA autocast: use --device cuda, or --precision fp32")
    if spec == 'bf16':
        with torch.cuda.device(dev):
            if not torch.cuda.is_bf16_supported():
                raise ValueError("bf16: this GPU does not support bfloat16 (use fp16)")
    return spec

def precision_callbacks(precision:str)->list:
    """fastai's `MixedPrecision` for fp16/bf16 (after `GradientAccumulation`: one scaler update per window), none for
    fp32"""
    if precision == 'fp32': return []
    from fastai.callback.fp16 import MixedPrecision
    return [MixedPrecision(amp_mode=precision)]

# -- BatchNorm mode -------------------------------------------------------------------------------------------------
# From the studies: nbs/02_batchnorm_study.ipynb (docs/assets/study_results.csv, docs/assets/study_scratch.csv) and
# bench/bn_precise_study.py (docs/assets/bn_precise_digits.csv, docs/assets/bn_precise_scratch.csv); the figures in
# docs/batchnorm.md
AUTO_FULL_BS = 16   # micro-batches at least this large: plain BatchNorm statistics are as good as the large batch's
AUTO_GROUPNORM_BELOW = 8   # from scratch, micro-batches smaller than this train with GroupNorm
# `--bn auto`'s 'pool' recomputes the running statistics from this many items at the last epoch's end
PRECISE_ITEMS = 512

def auto_bn(micro_bs:int, n_step:int, pretrained:bool, has_bn:bool=True)->str:
    "The `--bn auto` choice, by micro-batch size and whether the network starts from pretrained weights"
    if not has_bn or n_step == 1 or micro_bs >= AUTO_FULL_BS: return 'none'
    # From scratch, BatchNorm trained on micro-batches of 2 or 4 can be far off: resnet18 on 430 digits, 2 epochs,
    # reached
    # 0.49-0.60 with plain BatchNorm or 'pool' (recomputed statistics or not) where GroupNorm reached 0.98 (3 seeds); on
    # the job's resnet_tiny 'pool' was 2.8 points above GroupNorm, within the noise of 3 seeds. GroupNorm's worst case
    # is
    # the smaller loss. From micro-batch 8, or with pretrained weights, 'pool' with recomputed statistics was the best
    # or within 0.2 points of it in every cell measured.
    if not pretrained and micro_bs < AUTO_GROUPNORM_BELOW: return 'groupnorm'
    return 'pool'

def auto_precise(mode:str)->int|None:
    """`--bn-precise auto`: with 'pool', the running statistics recomputed from `PRECISE_ITEMS` training items at the
    end of the last epoch (a short run's big-batch statistics lag its weights: 0.58 -> 0.87 after one epoch on the
    digits)"""
    return PRECISE_ITEMS if mode == 'pool' else None

# -- learner --------------------------------------------------------------------------------------------------------
class Throughput(Callback):
    "Training images per second and peak memory (GPU: `max_memory_allocated`; CPU: the process's peak resident size)"
    order,run_valid = 100,False
    def before_fit(self):
        self.n,self.secs = 0,0.
        self.on_gpu = torch.device(self.dls.device or 'cpu').type == 'cuda'
        if self.on_gpu: torch.cuda.reset_peak_memory_stats()
    def before_train(self): self._sync(); self.t0 = time.perf_counter()
    def after_batch(self): self.n += find_bs(self.yb)
    def after_train(self): self._sync(); self.secs += time.perf_counter()-self.t0
    def _sync(self):
        if self.on_gpu: torch.cuda.synchronize()
    @property
    def images_per_s(self)->float: return self.n/self.secs if self.secs else float('nan')
    @property
    def peak_memory_mib(self)->float:
        if self.on_gpu: return torch.cuda.max_memory_allocated()/2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024   # Linux reports KiB

def build_learner(dls, arch:str=DEFAULT_ARCH, *, weights:str|None=None, n_step:int=8, bn:str='auto',
                  precision:str='fp32', lr:float=3e-3, seed:int=0, micro_bs:int|str|None=None, cbs=(),
                  bn_precise:int|str|None='auto', precise_at:str='end', effective_bs:int|None=None)->Learner:
    """A fastai `Learner` of `arch` (from `weights`) on `dls`, with `GradientAccumulation(n_step=n_step)` (and
    `MicroBatching(micro_bs)`), the BatchNorm callback for `bn` ('auto': `auto_bn`), `precision`'s callbacks and `cbs`.
    Seeds everything from `seed` (the loaders' shuffling too), so the same call gives the same run. The micro-batch is
    `dls.train.bs`, or `micro_bs` items of each loader batch ('auto': the fastest that fits; then `bn='auto'` is 'pool',
    exact at any size found). `bn_precise`: training items the running statistics are recomputed from
    (`BatchNormAccumulation(precise=N)`) at the last epoch's end (`precise_at='end'`, before the final validation) or
    every epoch's ('epoch'); 'auto': `auto_precise` of the mode `bn='auto'` chose, none for a mode given; None or 0:
    none. `effective_bs` (loader batches uncut): each window that many samples over all processes, the same on any
    number of them (`global_window`: a run stopped on 2 processes resumes on 1 as the same run), `n_step` the loader
    batches a process takes for it."""
    if bn not in JOB_BN_MODES: raise ValueError(f"`bn` must be one of {JOB_BN_MODES}, got {bn!r}")
    set_seed(seed, reproducible=True)
    # fastai loaders draw their shuffling seed from Python's `random` when they are built, before this call: reseed
    # them, so that the same `seed` gives the same sample order, whatever ran before in the process
    for i,dl in enumerate(dls.loaders): dl.rng = random.Random(seed+i)
    model = create_model(arch, dls.c)
    pretrained = (load_weights(model, weights, arch) if weights else 0) > 0
    if bn != 'auto': mode = bn
    elif micro_bs == 'auto': mode = 'pool' if has_batchnorm(model) else 'none'
    else:
        mode = auto_bn(micro_bs or dls.train.bs, n_step*n_pieces(dls.train.bs, micro_bs or dls.train.bs), pretrained,
                       has_batchnorm(model))
    precise = (auto_precise(mode) if bn == 'auto' else None) if bn_precise == 'auto' else (bn_precise or None)
    if precise and mode in ('none', 'freeze'):
        raise ValueError(f"`bn_precise`: recomputed statistics need BatchNormAccumulation, and bn={mode!r} "
                         + ("has none" if mode == 'none'
                            else "keeps the statistics frozen") + ": give another `bn`, or no `bn_precise`")
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, lr=lr,
                    cbs=_accumulation(n_step, micro_bs, effective_bs) + ([BatchNormAccumulation(mode, precise=precise,
                                                                                                precise_at=precise_at)]
                                                                         if mode != 'none' else [])
                        + precision_callbacks(precision) + [Throughput()] + list(cbs))
    learn.job = dict(arch=arch, weights=str(weights) if weights else None, pretrained=pretrained, bn=mode,
                     bn_precise=precise,
                     bn_requested=bn, precision=precision, seed=seed, n_step=n_step)
    return learn

def _accumulation(n_step:int, micro_bs, effective_bs:int|None)->list:
    if effective_bs is not None and micro_bs is None:
        return [GradientAccumulation(target_bs=effective_bs, global_window=True)]
    return [GradientAccumulation(n_step=n_step)] + ([MicroBatching(micro_bs)] if micro_bs is not None else [])

def finetune(learn:Learner, epochs:int=3, lr:float|None=None, progress:bool=True, cbs=None)->dict:
    """Fine-tune a `build_learner` Learner with one cycle for `epochs` (`cbs`: for this fit, e.g. a `Checkpoint`);
    return its metrics"""
    lr = lr if lr is not None else learn.lr
    t0 = time.perf_counter()
    if progress: learn.fit_one_cycle(epochs, lr, cbs=cbs)
    else:
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, lr, cbs=cbs)
    secs = time.perf_counter()-t0
    rec,ga,tp,job,dls = learn.recorder,learn.gradient_accumulation,learn.throughput,learn.job,learn.dls
    accs = [float(v[2]) for v in rec.values]
    bs,mb = dls.train.bs,micro_batching(learn)
    return dict(accuracy=accs[-1], valid_loss=float(rec.values[-1][1]), accuracy_per_epoch=accs,
                micro_bs=(mb.size if mb is not None else None) or bs, loader_bs=bs,
                effective_bs=bs*job['n_step']*process_count(),
                n_step=job['n_step'], processes=process_count(),
                micro_bs_mode='auto' if mb is not None and mb.auto else 'fixed',
                micro_bs_trials={str(k): round(v, 1) for k,v in (mb.trials if mb is not None else {}).items()},
                bn=job['bn'],
                bn_precise=_precise_items(learn, job['bn_precise']), bn_requested=job['bn_requested'],
                epochs=epochs, optimizer_steps=ga.steps, lr=lr, seed=job['seed'], arch=job['arch'],
                weights=job['weights'], pretrained=job['pretrained'],
                n_train=len(dls.train.dataset), n_valid=len(dls.valid.dataset), train_seconds=round(secs, 1),
                device=describe_device(next(learn.model.parameters()).device), precision=job['precision'],
                images_per_s=round(tp.images_per_s*process_count(), 1), peak_memory_mib=round(tp.peak_memory_mib, 1),
                classes=[str(c) for c in getattr(dls, 'vocab', [])])

def _precise_items(learn, asked):
    "The items the running statistics were last recomputed from (all of a training set smaller than `asked`), or None"
    bna = getattr(learn, 'batch_norm_accumulation', None)
    return getattr(bna, 'precise_items', None) if asked else None

# -- outputs --------------------------------------------------------------------------------------------------------
def plot_training(learn:Learner, metrics:dict, fname):
    "PNG of the training curves: window loss against optimizer steps, validation accuracy per epoch"
    from matplotlib.figure import Figure   # no pyplot: no global backend to set
    fig = Figure(figsize=(10,3.8))
    a0,a1 = fig.subplots(1, 2)
    learn.gradient_accumulation.plot_windows(a0)
    a0.set_title(f"micro-batch {metrics['micro_bs']}, {metrics['loader_bs']} x {metrics['n_step']} = "
                 f"{metrics['effective_bs']} per step, bn={metrics['bn']}")
    accs = metrics['accuracy_per_epoch']
    a1.plot(range(1, len(accs)+1), accs, marker='o')
    a1.set_xlabel('epoch'); a1.set_ylabel('validation accuracy'); a1.set_title(f"final accuracy {accs[-1]:.3f}")
    a1.set_xticks(range(1, len(accs)+1))
    fig.tight_layout(); fig.savefig(fname, dpi=100)

def write_metrics(metrics:dict, fname):
    Path(fname).write_text(json.dumps(metrics, indent=2)+'\n')
