"""`accum-finetune` / `python -m accum_callback`: fine-tune an image classifier with exact gradient accumulation.

Bad input ends with one line on stderr naming the argument or path, exit status 2, and nothing written to `--out`:
everything is checked before training, and the outputs are written to a temporary folder moved into `--out` at the end.
The arguments are parsed before torch and fastai load (`--help` and argument errors answer at once), and Ctrl-C at any
moment ends with one line and exit status 130."""
from __future__ import annotations
import argparse, contextlib, os, re, shutil, sys, tempfile, warnings
from pathlib import Path

from accum_callback.batchnorm.modes import BN_MODES
from accum_callback.core.args import NotWholeNumber, whole_number   # (no torch: the CLI answers before it loads)
from .precheck import arch_known, data_problem, gpu_visible, unknown_arch

__all__ = ['PROG', 'UsageError', 'make_parser', 'check_args', 'main', 'run']

PROG = 'accum-finetune'
RESULTS = ('metrics.json', 'training.png', 'model.pkl')   # what a run writes into --out
_BN = ('auto', 'none') + BN_MODES   # = `finetune.JOB_BN_MODES`; `accum_callback.batchnorm.modes` imports nothing
_PRECISION = ('auto', 'fp32', 'fp16', 'bf16')   # = `finetune.PRECISIONS`

class UsageError(ValueError): "Bad command-line input, reported as one line"

def _micro_bs(v:str):
    if v == 'auto': return v
    try: return int(v)
    except ValueError: raise argparse.ArgumentTypeError(f"must be a whole number >= 1 or auto, got {v!r}") from None

class _Parser(argparse.ArgumentParser):
    def error(self, message): raise UsageError(message)   # one line, not argparse's usage block

def make_parser(prog:str=PROG)->argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Fine-tune an image classifier with exact gradient accumulation and a BatchNorm "
                "mode. With no --data: the embedded digits transfer task (pretrain on 0-4, fine-tune on 5-9).")
    a = p.add_argument
    a('--data', type=Path, default=None, metavar='DIR', help='one sub-folder of images per class, or train/ and valid/ '
      'each with one sub-folder per class (default: embedded digits 5-9)')
    a('--valid-pct', type=float, default=0.2, help='random validation fraction without train/ + valid/ (default: 0.2)')
    a('--arch', default='resnet_tiny', metavar='NAME', help='resnet_tiny (default), a torchvision model name, or timm/NAME')
    a('--weights', default=None, metavar='PATH|NAME|none',
      help='a local checkpoint, torchvision weights name (e.g. DEFAULT; downloaded where the network allows) or none. '
           'Default: resnet_tiny starts from its digits 0-4 checkpoint (built and cached on first use); other archs from scratch')
    a('--size', type=int, default=32, help='image side in pixels (default: 32)')
    a('--loader-bs', type=int, default=None, metavar='N', help="the loader's batch: samples per forward/backward unless "
      "--micro-bs cuts it (default: 4; --effective-bs with --micro-bs auto)")
    a('--micro-bs', type=_micro_bs, default=None, metavar='N|auto', help="GradientAccumulation's micro_bs: cut each loader "
      "batch into micro-batches of N, or auto: the fastest that fits the GPU, found by halving after an out-of-memory "
      "error. Without --loader-bs, a number is the old spelling of --loader-bs N (the same samples per forward/backward)")
    g = p.add_mutually_exclusive_group()
    g.add_argument('--effective-bs', type=int, default=None, help='samples per optimizer step (default: 32)')
    g.add_argument('--n-step', type=int, default=None, help='loader batches per optimizer step (instead of --effective-bs)')
    a('--bn', default='auto', choices=_BN, metavar='MODE', help=f"BatchNorm mode: {', '.join(_BN)} (default: auto)")
    a('--bn-precise', default='auto', metavar='N|auto', help="recompute the BatchNorm running statistics from N training "
      "items with the final weights before the last validation (0: never; default auto: 512 when --bn auto picks pool)")
    a('--epochs', type=int, default=3, help='default: 3')
    a('--lr', type=float, default=3e-3, help='peak one-cycle learning rate (default: 3e-3)')
    a('--seed', type=int, default=0, help='default: 0')
    a('--device', default='auto', metavar='auto|cpu|cuda|cuda:N', help='where to train (default auto: the GPU when there is one)')
    a('--precision', default='auto', choices=_PRECISION, metavar='auto|fp32|fp16|bf16',
      help='mixed precision through fastai\'s MixedPrecision (default auto: bf16 where the GPU has it, else fp16 on CUDA, fp32 on CPU)')
    a('--threads', type=int, default=1, help='torch CPU threads (default: 1, fastest for the small default net)')
    a('--out', type=Path, default=Path('runs/finetune'), metavar='DIR', help='where metrics.json, training.png and '
      'model.pkl go (default: runs/finetune)')
    a('--overwrite', action='store_true', help='replace the results of an earlier run in --out (otherwise refused)')
    a('--resume', action='store_true', help='continue the run that was interrupted in --out from its last checkpoint '
      '(--out/checkpoints), to the results the uninterrupted run would have given; same arguments as that run')
    a('--checkpoint-minutes', type=float, default=5., metavar='M', help='save a checkpoint every M minutes of training '
      'and at each epoch end, into --out/checkpoints (removed when the run finishes); SIGTERM saves one and stops '
      '(exit 143); 0: none (default 5)')
    a('--cache', default=None, metavar='DIR|off', help="where --data's images are kept decoded (each decoded once, "
      "resized, then read as arrays; rebuilt when a file changes): default the job's cache folder "
      "($ACCUM_CALLBACK_CACHE/images); off: fastai's pipeline, every image decoded in every epoch")
    a('--augment', action=argparse.BooleanOptionalAction, default=None, help="fastai's aug_transforms (flips, a small "
      "rotation/zoom/warp, lighting, a random-resized crop) on the training batches, on the device: default on for "
      "--data, off for the embedded digits (on them without flips or lighting)")
    a('--check', action='store_true', help="before training, print `learn.check_accumulation()`: is the accumulated "
      "gradient the big batch's on this model and data, and if not, why")
    a('--check-only', action='store_true', help='print the check and exit without training (nothing written)')
    return p

def check_args(args)->argparse.Namespace:
    "Check the numbers and resolve `n_step`/`effective_bs`, or raise a `UsageError` naming the argument"
    for k in ('loader_bs', 'micro_bs', 'epochs', 'size', 'threads', 'n_step', 'effective_bs'):
        v = getattr(args, k)
        try:
            if v is not None and v != 'auto': whole_number(v, k)   # the library's rule for every count
        except NotWholeNumber: raise UsageError(f"argument --{k.replace('_','-')}: must be >= 1, got {v}") from None
    if args.bn_precise != 'auto':
        try: args.bn_precise = whole_number(int(args.bn_precise), 'bn_precise', lo=0)
        except (ValueError, NotWholeNumber): raise UsageError(f"argument --bn-precise: must be a whole number >= 0 or auto, got {args.bn_precise}") from None
        if args.bn_precise and args.bn in ('none', 'freeze'):
            raise UsageError(f"argument --bn-precise: --bn {args.bn} " + ("has no BatchNorm callback" if args.bn == 'none' else
                             "keeps the statistics frozen") + ": give another --bn, or --bn-precise 0")
    if not args.lr > 0: raise UsageError(f"argument --lr: must be > 0, got {args.lr}")
    if not args.checkpoint_minutes >= 0: raise UsageError(f"argument --checkpoint-minutes: must be >= 0, got {args.checkpoint_minutes}")
    if args.resume and not args.checkpoint_minutes: raise UsageError("argument --resume: continues from checkpoints, and --checkpoint-minutes 0 makes none")
    # (under torchrun a first attempt has none: `torchrun --max-restarts K ... --resume` starts afresh, restarts resume)
    if args.resume and not any((args.out/'checkpoints').glob('ckpt-*.pt')) and 'TORCHELASTIC_RESTART_COUNT' not in os.environ:
        raise UsageError(f"argument --resume: no checkpoint in {args.out/'checkpoints'} to continue from; run without --resume")
    if not 0 < args.valid_pct < 1: raise UsageError(f"argument --valid-pct: must be between 0 and 1, got {args.valid_pct}")
    bs_flag = '--loader-bs'
    world = _world()   # under torchrun / accelerate launch: --effective-bs is the global batch, over every process
    if isinstance(args.micro_bs, int) and args.loader_bs is None:   # the old spelling: --micro-bs N was the loader's batch
        args.loader_bs,args.micro_bs,bs_flag = args.micro_bs,None,'--micro-bs'
    if args.micro_bs == 'auto' and args.loader_bs is None:   # one loader batch of --effective-bs per step, cut into what fits
        if args.n_step is not None: raise UsageError("argument --n-step: counts loader batches of --loader-bs; with "
                                                     "--micro-bs auto alone give --effective-bs")
        args.effective_bs,args.n_step,args.global_window = 32 if args.effective_bs is None else args.effective_bs,1,False
        if args.effective_bs % world:
            raise UsageError(f"argument --effective-bs: {args.effective_bs} is not a multiple of the {world} processes")
        args.loader_bs = args.effective_bs//world
    else:
        if args.loader_bs is None: args.loader_bs = 4
        if isinstance(args.micro_bs, int) and args.micro_bs > args.loader_bs:
            raise UsageError(f"argument --micro-bs: {args.micro_bs} is larger than --loader-bs {args.loader_bs} (it cuts the loader's batches)")
        # --effective-bs (or its default) with whole loader batches: the same windows on any number of processes
        args.global_window = args.n_step is None and args.micro_bs is None
        if args.n_step is not None: args.effective_bs = args.loader_bs*args.n_step*world
        else:
            args.effective_bs = 32 if args.effective_bs is None else args.effective_bs
            per = args.loader_bs*world   # one loader batch on every process
            # (`global_window` deals each window's loader batches whole to the processes: any number of them; else each
            # process steps on its own loader batches, which the window must hold as many of on every process)
            unit,procs = (args.loader_bs,'') if args.global_window else (per,f" x {world} processes" if world > 1 else '')
            if unit > args.effective_bs:
                raise UsageError(f"argument {bs_flag}: {args.loader_bs}{procs} is larger than --effective-bs {args.effective_bs}")
            if args.effective_bs % unit:
                raise UsageError(f"argument --effective-bs: {args.effective_bs} is not a multiple of {bs_flag} {args.loader_bs}{procs}")
            args.n_step = -(-args.effective_bs//per)   # (the most loader batches a process runs a window)
    if args.out.exists() and not args.out.is_dir(): raise UsageError(f"--out {args.out}: exists and is not a folder")
    held = [f for f in RESULTS if (args.out/f).exists()]
    if held and not (args.overwrite or args.check_only):   # --check-only writes nothing
        raise UsageError(f"--out {args.out}: holds the results of an earlier run ({', '.join(held)}); pass --overwrite to "
                         "replace them, or choose another --out")
    if args.weights and args.weights.lower() == 'none': args.weights = 'none'
    if not re.fullmatch(r'auto|cpu|cuda(:\d+)?', args.device):
        raise UsageError(f"argument --device: {args.device!r} is not auto, cpu, cuda or cuda:N")
    # what needs no torch is checked here, before torch loads (an answer in milliseconds, not seconds)
    if args.data is not None and (problem := data_problem(args.data)): raise UsageError(problem)
    no_gpu = gpu_visible() is False
    if no_gpu and args.device.startswith('cuda'):
        raise UsageError(f"argument --device: {args.device}: no CUDA device on this machine (use --device cpu or auto)")
    if args.precision in ('fp16', 'bf16') and (args.device == 'cpu' or no_gpu):
        raise UsageError(f"argument --precision: {args.precision} trains through CUDA autocast: use --device cuda, or "
                         "--precision fp32")
    if arch_known(args.arch) is False:
        from importlib.util import find_spec
        raise UsageError(unknown_arch(args.arch, find_spec('timm') is not None))
    return args

def _summary(m:dict, source:str, files)->str:
    cut = f" (loader batches of {m['loader_bs']} cut), {m['loader_bs']} x {m['n_step']}" if m['micro_bs'] != m['loader_bs'] else f" x {m['n_step']}"
    if m.get('processes', 1) > 1: cut += f" x {m['processes']} processes"
    mb = (f"auto: {m['micro_bs']} found, {m['effective_bs']} per optimizer step" if m.get('micro_bs_mode') == 'auto' else
          f"{m['micro_bs']}{cut} = {m['effective_bs']} per optimizer step")
    rows = [('data', source), ('arch', f"{m['arch']} ({'pretrained: '+m['weights'] if m['pretrained'] else 'from scratch'})"),
            ('micro_bs x n_step', mb),
            ('bn', m['bn'] + (f", precise {m['bn_precise']}" if m.get('bn_precise') else '') + (' (auto)' if m['bn_requested'] == 'auto' else '')),
            ('device', m['device']),
            ('precision', m['precision']),
            ('epochs', f"{m['epochs']} ({m['n_train']} train / {m['n_valid']} valid images)"),
            ('optimizer_steps', m['optimizer_steps']),
            ('train time', f"{m['train_seconds']} s ({m['images_per_s']:.0f} images/s, peak memory {m['peak_memory_mib']:.0f} MiB)"),
            ('accuracy', f"{m['accuracy']:.4f}"), ('wrote', ', '.join(map(str, files)))]
    w = max(len(k) for k,_ in rows)
    return '\n'.join([f'{PROG} summary', '-'*(w+50)] + [f'{k:<{w}}  {v}' for k,v in rows])

def _image_cache()->Path:
    "The decode cache's default folder: `images/` in the job's cache folder (the pretrained checkpoint's)"
    from .pretrain import cache_dir
    return cache_dir()/'images'

def export(learn, fname, cached:bool=False):
    """`learn.export` for fastai's `load_learner(fname).predict(image_file)`, without training's callbacks (ours and the
    job's); it loads where this package is installed (the default model and the cached data's pipeline are the job's).
    With cached data, the Learner keeps an inference pipeline from image files instead (decode, resize, normalise:
    `cache.inference_dls`)"""
    from accum_callback.core.protocols import is_ours
    training = [cb for cb in learn.cbs if is_ours(cb) or type(cb).__module__.startswith('accum_finetune.')]
    dls = learn.dls
    if cached:
        from .cache import inference_dls
        learn.dls = inference_dls(*dls.inference)
    try:
        with learn.removed_cbs(training): learn.export(fname)
    finally: learn.dls = dls

def _run(args)->int:
    warnings.filterwarnings('ignore', category=FutureWarning)   # torch/fastai import-time deprecation notices
    with _ctrl_c_after():   # (a Ctrl-C during these imports is raised once they are done)
        import torch
        from .data import digits_dls, folder_dls
        from .models import DEFAULT_ARCH, check_arch
        from .finetune import build_learner, finetune, plot_training, resolve_device, resolve_precision, write_metrics
    check_arch(args.arch)
    try: device = resolve_device(args.device)
    except ValueError as e: raise UsageError(f"argument --device: {e}") from None
    world,rank = _world(),_rank()
    if world > 1: device = _join_processes(device)   # torchrun / accelerate launch: one process per GPU (or CPU share)
    try: precision = resolve_precision(args.precision, device)
    except ValueError as e: raise UsageError(f"argument --precision: {e}") from None
    torch.set_num_threads(args.threads)   # the command's choice; `finetune` as a library leaves threads alone
    cache = None if args.data is None or args.cache == 'off' else (Path(args.cache) if args.cache else _image_cache())
    augment = args.augment if args.augment is not None else args.data is not None   # off for the embedded digits
    bs = args.loader_bs
    # the data before any pretraining (fail fast): a folder is checked, and decoded into its cache if it has none
    # (several processes: rank 0 first, building the image cache and the checkpoint once; the others then read them)
    dls = _rank0_first(lambda: digits_dls(bs, size=args.size, valid_pct=args.valid_pct, seed=args.seed, device=device,
                                          augment=augment) if args.data is None else
                       folder_dls(args.data, bs, args.size, args.valid_pct, args.seed, device=device, cache=cache, augment=augment))
    weights = args.weights
    if weights is None and args.arch == DEFAULT_ARCH:
        from .pretrain import pretrained_checkpoint
        weights = str(_rank0_first(lambda: pretrained_checkpoint(DEFAULT_ARCH, args.size)))
    elif weights == 'none': weights = None
    tmp = Path(tempfile.mkdtemp(prefix='accum-finetune-'))
    # each window the same samples, dealt in whole loader batches, on any number of processes (`global_order.deal`): a
    # stop on one number resumes on another; `--n-step` and `--micro-bs` keep each process's own windows
    global_window = getattr(args, 'global_window', False)
    try:
        learn = build_learner(dls, args.arch, weights=weights, n_step=args.n_step, bn=args.bn, precision=precision,
                              lr=args.lr, seed=args.seed, micro_bs=args.micro_bs, bn_precise=args.bn_precise,
                              effective_bs=args.effective_bs if global_window else None)
        if args.check or args.check_only:
            print(learn.check_accumulation(), flush=True)
            if args.check_only: return 0
        ckpt = None
        if args.checkpoint_minutes:
            from accum_callback import Checkpoint
            _CHECKPOINTS.append(args.out.resolve()/'checkpoints')
            m = args.checkpoint_minutes   # (each epoch's end too; `inf` minutes: those only)
            every = ('1ep', f'{m!r}min') if m != float('inf') else '1ep'
            ckpt = Checkpoint(args.out.resolve()/'checkpoints', every=every, resume=args.resume, signals=('SIGTERM',))
        try:
            with _data_parallel(learn, device): m = finetune(learn, args.epochs, args.lr, cbs=[ckpt] if ckpt is not None else None)
        except SystemExit as e:
            if e.code != 143: raise
            print(f"{PROG}: stopped (SIGTERM), checkpoint saved in {args.out/'checkpoints'}: add --resume to continue", file=sys.stderr)
            return 143
        if ckpt is not None and ckpt.resumed_from is not None: m['resumed_from'] = str(ckpt.resumed_from)
        m['data'],m['cache'],m['augment'],m['global_window'] = dls.source,(str(cache) if cache is not None else None),augment,global_window
        if rank: return 0   # (one writer: rank 0 writes the results and prints the summary)
        write_metrics(m, tmp/'metrics.json'); plot_training(learn, m, tmp/'training.png')
        export(learn, tmp/'model.pkl', cached=cache is not None)
        _check_interrupted()   # (nothing is written after a Ctrl-C, wherever it landed)
        args.out.mkdir(parents=True, exist_ok=True)
        files = [_place(f, args.out/f.name) for f in sorted(tmp.iterdir())]   # replaces (--overwrite)
        shutil.rmtree(args.out/'checkpoints', ignore_errors=True)   # (the run is done: they served their purpose)
    finally: shutil.rmtree(tmp, ignore_errors=True)
    print(_summary(m, dls.source, files))
    return 0

# -- several processes (torchrun, accelerate launch) --------------------------------------------------------------------
def _world()->int: return int(os.environ.get('WORLD_SIZE', '1') or 1)
def _rank()->int: return int(os.environ.get('RANK', '0') or 0)

def _join_processes(device):
    """Join the process group the launcher describes (NCCL on GPUs, gloo on CPUs), before any data is read: this
    process's GPU is `LOCAL_RANK`'s. Returns the device"""
    import torch, torch.distributed as dist
    if device.type == 'cuda':
        device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', '0')))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        import datetime
        backend,timeout = 'nccl' if device.type == 'cuda' else 'gloo',datetime.timedelta(minutes=10)
        store = _attempt_store(timeout)
        if store is None: dist.init_process_group(backend, timeout=timeout)
        else: dist.init_process_group(backend, store=store, rank=_rank(), world_size=_world(), timeout=timeout)
    return device

def _attempt_store(timeout):
    """torchrun's store with this attempt's keys apart, when workers restart (`--max-restarts`): torchrun hands every
    attempt the same store, and the new workers' gloo (or NCCL) read the dead ones' addresses from it and fail with
    'Connection refused' (torch 2.14, pytorch#135712, #167288: a plain script fails alike). None: not under torchrun's
    agent store, `init_method='env://'` as usual. Attempts are counted per machine (TORCHELASTIC_RESTART_COUNT): over
    several machines a restart that only some agents count would not meet (docs/main_job.md)"""
    attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT')
    if attempt is None or os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or 'MASTER_ADDR' not in os.environ: return None
    import torch.distributed as dist
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), _world(), False, timeout=timeout)
    return dist.PrefixStore(f'accum_callback/attempt_{attempt}', store)

def _rank0_first(f):
    """`f()` on rank 0, then on each other machine's first process (`LOCAL_RANK` 0), then on the rest: the image cache
    and the pretrained checkpoint are built once where the cache folder is shared, once a machine where it is local, and
    the others find them. `f` runs alone (`_alone`): fastai's own calls in it (the checkpoint's pretraining) must not
    gather with processes that wait at the barrier. One process: just `f()`"""
    if _world() == 1: return f()
    import torch.distributed as dist
    rank,local = _rank(),int(os.environ.get('LOCAL_RANK', '0') or 0)
    turn = 0 if rank == 0 else 1 if local == 0 else 2
    for t in range(3):
        if t == turn:
            with _alone(): res = f()
        dist.barrier()
    return res

@contextlib.contextmanager
def _alone():
    """fastai reads `WORLD_SIZE` and `RANK` to gather its metrics and losses over the processes (`maybe_gather`): a fit
    run by one process alone (the pretraining, while the others wait) would wait for them forever. Within: one process"""
    saved = {k: os.environ.get(k) for k in ('WORLD_SIZE', 'RANK')}
    os.environ.update(WORLD_SIZE='1', RANK='0')
    try: yield
    finally:
        for k,v in saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v

@contextlib.contextmanager
def _data_parallel(learn, device):
    """Several processes: fastai's `distrib_ctx` (DDP through Accelerate, each process its shard of the data, validation
    gathered over the whole set), with its sample order shared over gloo on CPUs. BatchNorm as `--bn` says, per
    process; DDP then gives every process rank 0's running statistics (docs/main_job.md)"""
    if _world() == 1: yield; return
    from accum_callback.core.distributed import gloo_distributed_dl
    with (gloo_distributed_dl() if device.type == 'cpu' else contextlib.nullcontext()), \
         learn.distrib_ctx(sync_bn=False, **(dict(cpu=True) if device.type == 'cpu' else {})):
        yield

def _place(src:Path, dest:Path)->Path:
    "Copy `src` to `dest` through `atomic_write`: a cut leaves the earlier `dest` or the whole new one, never a part"
    from accum_callback.core.files import atomic_write
    with open(src, 'rb') as f, atomic_write(dest) as out: shutil.copyfileobj(f, out, 1 << 20)
    return dest

def main(argv=None, prog:str=PROG)->int:
    "Entry point of `accum-finetune` and `python -m accum_callback` (`prog`: how it was called, for its messages); returns the exit status"
    try: return _main(argv, prog)
    except Exception:
        # a Ctrl-C that an import turned into another error (a module half imported when it landed): still an interrupt
        if _INTERRUPTED: return _interrupted(prog)
        raise

def _main(argv, prog:str)->int:
    try: return _run(check_args(make_parser(prog).parse_args(argv)))
    except KeyboardInterrupt: return _interrupted(prog)
    except UsageError as e: return _fail(e, prog)
    except OSError as e:
        from .cache import CacheError
        if not isinstance(e, CacheError): raise
        return _fail(e, prog)
    except ValueError as e:
        from .data import DataError
        from .models import ArchError
        if type(e).__name__ == 'CheckpointError': return _fail(_refused_resume(e), prog)
        if not isinstance(e, (DataError, ArchError)): raise
        return _fail(e, prog)

def _refused_resume(e)->str:
    """A refused `--resume` in the job's terms: what differs, and the job's ways on (the library's message names
    `Checkpoint(resume=False)` and `strict=False`, which a job user cannot pass)"""
    import re
    msg = str(e).split('\n')[-1].strip().removeprefix('Checkpoint: ')
    m = re.match(r'cannot resume (\S+) exactly, (.*?)\. Run the fit as it was', msg, re.S)
    what = (f"{m.group(1)} is of another run ({m.group(2)[:300]})" if m else
            re.sub(r';? ?(start afresh with|Run the fit as it was).*', '', msg)[:400])
    return (f"argument --resume: {what}; run the job as it was to continue it, or start afresh without --resume "
            "(with --overwrite to replace the results) or into another --out")

_INTERRUPTED = []   # SIGINT seen (`run` installs the handler): checked where a library might have swallowed its KeyboardInterrupt
_DEFERRED = []      # inside `_ctrl_c_after()`: the handler records a SIGINT and returns

def _check_interrupted():
    "Ctrl-C came earlier but its KeyboardInterrupt was deferred or swallowed (a bare `except:` in an import): honour it here"
    if _INTERRUPTED: raise KeyboardInterrupt

@contextlib.contextmanager
def _ctrl_c_after():
    """A Ctrl-C inside this block is raised at its end. For imports: Python runs a signal handler at the next bytecode,
    which during `import torch` can be Python code that native code called, where a KeyboardInterrupt cannot cross back:
    the process aborts ('terminate called after throwing an instance of python_error', status -6: seen once, in CI,
    with a Ctrl-C 1 s into the job's imports)"""
    _DEFERRED.append(True)
    try: yield
    finally: _DEFERRED.pop()
    _check_interrupted()

def run(prog:str=PROG):
    """`accum-finetune`, `python -m accum_callback` and `python -m accum_finetune`: `main()`'s status as the process's exit
    status. After Ctrl-C it leaves with `os._exit(130)`: CPython kills itself with SIGINT at exit when a KeyboardInterrupt
    once crossed code run through its C API (as imports can), even one that was caught, turning 130 into -2."""
    import signal
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler: signal.signal(signal.SIGINT, _on_sigint)
    code = main(prog=prog)
    if code == 130: sys.stdout.flush(); sys.stderr.flush(); os._exit(130)
    sys.exit(code)

def _on_sigint(sig, frame):
    "The job's SIGINT handler: recorded, and a `KeyboardInterrupt` unless inside `_ctrl_c_after()`"
    _INTERRUPTED.append(sig)
    if not _DEFERRED: raise KeyboardInterrupt

_CHECKPOINTS = []   # the run's checkpoint folder, once `--checkpoint-minutes` made one: a Ctrl-C leaves it for --resume

def _interrupted(prog:str)->int:
    "Ctrl-C: one line (under a launcher every process is interrupted: rank 0 says it), status 130"
    if _rank() == 0:
        kept = next((f for f in _CHECKPOINTS if f.is_dir() and any(f.iterdir())), None)
        print(f'{prog}: interrupted; nothing written' + (f' but the checkpoints in {kept}: add --resume to continue' if kept else ''),
              file=sys.stderr)
    return 130

def _fail(e, prog:str=PROG)->int: print(f'{prog}: error: {e}', file=sys.stderr); return 2
