"""`accum-finetune` / `python -m accum_callback`: fine-tune an image classifier with exact gradient accumulation.

Bad input ends with one line on stderr naming the argument or path, exit status 2, and nothing written to `--out`:
everything is checked before training, and the outputs are written to a temporary folder moved into `--out` at the end."""
from __future__ import annotations
import argparse, re, shutil, sys, tempfile, warnings
from pathlib import Path

__all__ = ['PROG', 'UsageError', 'make_parser', 'check_args', 'main']

PROG = 'accum-finetune'
_BN = ('auto', 'none', 'pool', 'momentum', 'freeze', 'groupnorm', 'renorm')   # = `train.BN_MODES`, without importing torch

class UsageError(ValueError): "Bad command-line input, reported as one line"

class _Parser(argparse.ArgumentParser):
    def error(self, message): raise UsageError(message)   # one line, not argparse's usage block

def make_parser()->argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Fine-tune an image classifier with exact gradient accumulation and a BatchNorm "
                "mode. With no --data: the embedded digits transfer task (pretrain on 0-4, fine-tune on 5-9).")
    a = p.add_argument
    a('--data', type=Path, default=None, metavar='DIR', help='one sub-folder of images per class (default: embedded digits 5-9)')
    a('--valid-pct', type=float, default=0.2, help='random validation fraction (default: 0.2)')
    a('--arch', default='resnet_tiny', metavar='NAME', help='resnet_tiny (default), a torchvision model name, or timm/NAME')
    a('--weights', default=None, metavar='PATH|NAME|none',
      help='a local checkpoint, torchvision weights name (e.g. DEFAULT; downloaded where the network allows) or none. '
           'Default: resnet_tiny starts from its digits 0-4 checkpoint (built and cached on first use); other archs from scratch')
    a('--size', type=int, default=32, help='image side in pixels (default: 32)')
    a('--micro-bs', type=int, default=4, help='samples per forward/backward (default: 4)')
    g = p.add_mutually_exclusive_group()
    g.add_argument('--effective-bs', type=int, default=None, help='samples per optimizer step (default: 32)')
    g.add_argument('--n-step', type=int, default=None, help='micro-batches per optimizer step (instead of --effective-bs)')
    a('--bn', default='auto', choices=_BN, metavar='MODE', help=f"BatchNorm mode: {', '.join(_BN)} (default: auto)")
    a('--epochs', type=int, default=3, help='default: 3')
    a('--lr', type=float, default=3e-3, help='peak one-cycle learning rate (default: 3e-3)')
    a('--seed', type=int, default=0, help='default: 0')
    a('--device', default='auto', metavar='auto|cpu|cuda|cuda:N', help='where to train (default auto: the GPU when there is one)')
    a('--threads', type=int, default=1, help='torch CPU threads (default: 1, fastest for the small default net)')
    a('--out', type=Path, default=Path('runs/finetune'), metavar='DIR', help='where metrics.json and training.png go '
      '(default: runs/finetune)')
    return p

def check_args(args)->argparse.Namespace:
    "Check the numbers and resolve `n_step`/`effective_bs`, or raise a `UsageError` naming the argument"
    for k in ('micro_bs', 'epochs', 'size', 'threads', 'n_step', 'effective_bs'):
        v = getattr(args, k)
        if v is not None and v < 1: raise UsageError(f"argument --{k.replace('_','-')}: must be >= 1, got {v}")
    if not args.lr > 0: raise UsageError(f"argument --lr: must be > 0, got {args.lr}")
    if not 0 < args.valid_pct < 1: raise UsageError(f"argument --valid-pct: must be between 0 and 1, got {args.valid_pct}")
    if args.n_step is not None: args.effective_bs = args.micro_bs*args.n_step
    else:
        args.effective_bs = 32 if args.effective_bs is None else args.effective_bs
        if args.micro_bs > args.effective_bs:
            raise UsageError(f"argument --micro-bs: {args.micro_bs} is larger than --effective-bs {args.effective_bs}")
        if args.effective_bs % args.micro_bs:
            raise UsageError(f"argument --effective-bs: {args.effective_bs} is not a multiple of --micro-bs {args.micro_bs}")
        args.n_step = args.effective_bs//args.micro_bs
    if args.out.exists() and not args.out.is_dir(): raise UsageError(f"--out {args.out}: exists and is not a folder")
    if args.weights and args.weights.lower() == 'none': args.weights = 'none'
    if not re.fullmatch(r'auto|cpu|cuda(:\d+)?', args.device):
        raise UsageError(f"argument --device: {args.device!r} is not auto, cpu, cuda or cuda:N")
    return args

def _summary(m:dict, source:str, files)->str:
    rows = [('data', source), ('arch', f"{m['arch']} ({'pretrained: '+m['weights'] if m['pretrained'] else 'from scratch'})"),
            ('micro_bs x n_step', f"{m['micro_bs']} x {m['n_step']} = {m['effective_bs']} per optimizer step"),
            ('bn', m['bn'] + (' (auto)' if m['bn_requested'] == 'auto' else '')), ('device', m['device']),
            ('epochs', f"{m['epochs']} ({m['n_train']} train / {m['n_valid']} valid images)"),
            ('optimizer_steps', m['optimizer_steps']), ('train time', f"{m['train_seconds']} s"),
            ('accuracy', f"{m['accuracy']:.4f}"), ('wrote', ', '.join(map(str, files)))]
    w = max(len(k) for k,_ in rows)
    return '\n'.join([f'{PROG} summary', '-'*(w+50)] + [f'{k:<{w}}  {v}' for k,v in rows])

def _run(args)->int:
    warnings.filterwarnings('ignore', category=FutureWarning)   # torch/fastai import-time deprecation notices
    from .data import DataError, check_folder, digits_dls, folder_dls
    from .train import ArchError, DEFAULT_ARCH, check_arch, finetune, plot_training, resolve_device, write_metrics
    check_arch(args.arch)
    try: device = resolve_device(args.device)
    except ValueError as e: raise UsageError(f"argument --device: {e}") from None
    images = check_folder(args.data) if args.data is not None else None   # before any pretraining: fail fast
    weights = args.weights
    if weights is None and args.arch == DEFAULT_ARCH:
        from .pretrain import pretrained_checkpoint
        weights = str(pretrained_checkpoint(DEFAULT_ARCH, args.size))
    elif weights == 'none': weights = None
    dls = (digits_dls(args.micro_bs, size=args.size, valid_pct=args.valid_pct, seed=args.seed) if args.data is None else
           folder_dls(args.data, args.micro_bs, args.size, args.valid_pct, args.seed, files=images))
    dls.to(device)
    tmp = Path(tempfile.mkdtemp(prefix='accum-finetune-'))
    try:
        learn,m = finetune(dls, args.arch, weights, args.micro_bs, args.n_step, args.bn, args.epochs, args.lr,
                           args.seed, threads=args.threads)
        m['data'] = dls.source
        write_metrics(m, tmp/'metrics.json'); plot_training(learn, m, tmp/'training.png')
        args.out.mkdir(parents=True, exist_ok=True)
        files = [Path(shutil.move(f, args.out/f.name)) for f in sorted(tmp.iterdir())]
    finally: shutil.rmtree(tmp, ignore_errors=True)
    print(_summary(m, dls.source, files))
    return 0

def main(argv=None)->int:
    "Entry point of `accum-finetune` and `python -m accum_callback`; returns the exit status"
    try: return _run(check_args(make_parser().parse_args(argv)))
    except KeyboardInterrupt: print(f'{PROG}: interrupted; nothing written', file=sys.stderr); return 130
    except UsageError as e: return _fail(e)
    except ValueError as e:
        from .data import DataError
        from .train import ArchError
        if not isinstance(e, (DataError, ArchError)): raise
        return _fail(e)

def _fail(e)->int: print(f'{PROG}: error: {e}', file=sys.stderr); return 2
