"""Running `bench real`'s stages: the source and its data, then each stage in its own process (or this one), reused
only when every setting it reads is as before."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from dha_train.bench_settings import RealSettings, transfer_batches
from dha_train.bench_support import bench_source
from dha_train.config import ConfigError
from dha_train.conversion.deepseek_choice import CHOICE_TOKENS
from dha_train.conversion.refit import REFIT_REPORT, RefitSettings, refit_folder
from dha_train.data.corpus import build_stdlib_corpus
from dha_train.data.prep import prep_redpajama
from dha_train.evaluation import DOCUMENTS_FILE, run_eval
from dha_train.export import export_hf
from dha_train.harness import headline
from dha_train.heldout_texts import (
    HELDOUT_DOMAIN,
    HELDOUT_SOURCE,
    heldout_documents,
    share_cap_chars,
    text_documents,
    tokenize_documents,
)
from dha_train.model_folders import folder_digest
from dha_train.models.head_map import HeadMap
from dha_train.paths import recipe_path
from dha_train.stages import BatchDigests, Stage, mean_eval_curve, train_stage, train_tokens


def say(message: str) -> None:
    print(f'[bench real] {message}', flush=True)


def command_line() -> str:
    """This process's command as a user would type it again (``dha-train ...``), for a results file's record."""
    return shlex.join(['dha-train', *sys.argv[1:]])


def run_stage(work: Path, name: str, build, isolated: bool, say=say) -> dict:
    def build_in_folder(folder: Path) -> dict:  # this bench's stages write into a folder made for them
        folder.mkdir(parents=True, exist_ok=True)
        return build(folder)

    # each stage in its own process (isolated): one process building 135M model after model grew ~1 GB per stage
    return Stage(work, name).run(build_in_folder, say, isolated=isolated)


# --- source and data ---------------------------------------------------------------------------------------------
def source_folder(work: Path, source: str) -> Path:
    return bench_source(work, source, say=say)


def text_folder(runner: StageRunner, name: str, where: str, files: list[Path], *, seed: int, tokens: int,
                seq_len: int, max_document_chars: int | None = None) -> Path:
    """The documents of ``files`` tokenized with the source's tokenizer into a val split of ``tokens`` (a stage of
    ``runner``, reused when run again): a text some bench scores on and no stage trains on. ``max_document_chars``
    keeps each document's first that many characters, so the split's sequences come from more documents (a few
    long ones would fill it alone, and their sequences are not independent samples of the text)."""

    def build(out: Path) -> dict:
        documents = [(text[:max_document_chars], meta) for text, meta in text_documents(files, seed=seed)]
        if not documents:
            raise ConfigError(f'no text (.html, .txt, .md, .rst, .pod, .pm, .h files of 2,000+ characters) in {where}')
        domain = tokenize_documents(documents, out, runner.source, name, seq_len=seq_len, val_tokens=tokens, say=say)
        return {'root': str(out / 'data'), 'source': where, 'documents': len(documents), 'val': domain['val'],
                'units': domain['units']}

    reads = {'where': where, 'files': [str(p) for p in files], 'tokens': tokens, 'seq_len': seq_len, 'seed': seed}
    if max_document_chars is not None:
        reads['max_document_chars'] = max_document_chars
    return Path(runner.stage(runner.work, f'data-{name}', build, **reads)['root'])


def prepare_data(work: Path, tokenizer: Path, settings: RealSettings, source_digest: str) -> tuple[Path, Path, dict]:
    """The training data (the stdlib corpus) and the held-out validation data (/usr/share/doc), both tokenized
    with the source's tokenizer at the bench's sequence length; their folders are named by the source's digest
    too, so another model in a folder of the same name never reads data made with the old tokenizer."""
    cap = 'all' if settings.corpus_bytes is None else str(settings.corpus_bytes)

    def train_data(out: Path) -> dict:
        corpus = out / 'corpus'
        stats = build_stdlib_corpus(corpus, max_bytes_per_domain=settings.corpus_bytes, seed=0)
        # A small val split, the user's own held-out data as `data prep` makes it: DeepSeek-format conversions choose
        # their split and balance on it (conversion.deepseek_choice); no row is scored on it (the held-out text is
        # another source).
        manifest = prep_redpajama([corpus], out / 'data', tokenizer, seq_len=settings.seq_len,
                                  val_tokens=CHOICE_TOKENS,
                                  overwrite=True, progress=False)
        shutil.rmtree(corpus)
        return {'root': str(out / 'data'), 'corpus': stats, 'domains': sorted(manifest['domains']),
                'source': 'the Python standard library: .py sources (github) and module docstrings (wikipedia)'}

    def heldout_data(out: Path) -> dict:
        documents = heldout_documents(max_bytes=max(8 * settings.val_tokens, 400_000),
                                      max_document_chars=share_cap_chars(settings.val_tokens))
        if not documents:
            raise RuntimeError(f'bench real: no held-out text found under {HELDOUT_SOURCE}')
        val = tokenize_documents(documents, out, tokenizer, f'{HELDOUT_DOMAIN}-heldout', seq_len=settings.seq_len, say=say,
                                 val_tokens=settings.val_tokens)
        return {'root': str(out / 'data'), 'documents': len(documents), 'domain_label': HELDOUT_DOMAIN,
                'split_evaluated': 'val', 'manifest': val, 'units': val['units'],
                'source': f'{HELDOUT_SOURCE} text files (READMEs, NEWS, changelogs, .txt/.md/.rst; no licences, '
                          'no Python-related folders), a source no row trains on'}

    if settings.train_data is not None:
        train = {'root': str(Path(settings.train_data).resolve()), 'source': f'given: {settings.train_data}'}
    else:
        train = run_stage(work, f'data-train-{tokenizer.name}-{source_digest[:8]}-s{settings.seq_len}-{cap}'
                                f'-v{CHOICE_TOKENS}',
                           train_data, settings.isolate_stages)
    heldout = run_stage(work, f'data-heldout-{tokenizer.name}-{source_digest[:8]}-s{settings.seq_len}'
                               f'-v{settings.val_tokens}', heldout_data, settings.isolate_stages)
    return Path(train['root']), Path(heldout['root']), {'train': train, 'heldout': heldout}


# --- running stages -----------------------------------------------------------------------------------------------
class StageRunner:
    """Runs one bench's stages: each in a folder keyed on every setting it reads (``stage``), a recipe run and its
    export (``train``), an evaluation row (``evaluate``), the healing chain after a 0-token conversion (``heal``).
    ``RealBench`` (methods.py) says which stages each method runs, in which order."""

    def __init__(self, settings: RealSettings, work: Path, source: Path, source_digest: str, train_data: Path,
                 heldout: Path):
        self.settings, self.work, self.source = settings, work, source
        self.train_data, self.heldout = train_data, heldout
        self.source_map = HeadMap.from_hf_config(model_config(source))
        self.batches = max(settings.tokens // (settings.batch * settings.seq_len), 1)
        self.tokens = self.batches * settings.batch * settings.seq_len
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.healing_starts: dict[str, str] = {}  # a healing start's model digest -> the label its rows carry
        self.task_data: dict = {}
        # A stage is reused only when everything it reads is as before: its folder is named by a digest of the
        # settings and input folders it reads (``stage``) and of what every stage reads: the source's files (another
        # model in a folder of the same name is another source), the training data (its folder and manifest: another
        # --train-data or corpus size) and the device. A stage's input model is a path inside the stage that made it,
        # so a changed stage changes the keys of every stage after it.
        manifests = {name: (Path(root) / 'manifest.json').read_text() if (Path(root) / 'manifest.json').is_file()
                     else None for name, root in (('train', train_data), ('heldout', heldout))}
        self.common = {'source': source_digest, 'train_data': str(train_data), 'manifests': manifests,
                       'device': settings.device}
        self.runs = work / 'runs' / source.name
        self.evals = self.runs / 'eval'

    def stage(self, work: Path, name: str, build, **reads) -> dict:
        """``build`` as the stage ``name``, in a folder named by ``name`` and a digest of ``reads`` (every setting
        and input the build reads) and of ``self.common``."""
        inputs = json.dumps({'common': self.common, **reads}, sort_keys=True, default=str)
        # paths inside the bench's folder count from it, so the folder may move and keep its stages
        digest = hashlib.sha256(inputs.replace(str(self.work), '<bench>').encode()).hexdigest()[:10]
        return run_stage(work, f'{name}-{digest}', build, self.settings.isolate_stages)

    # common recipe overrides: folders, batch, device, steps
    def overrides(self, name: str, steps: int, seed: int | None = None, **variables) -> list[str]:
        s = self.settings
        # warm-up: 10% of the run, none under 10 batches (Composer's warm-up starts at lr 0, so a 1-batch warm-up
        # of a 1-batch run would train nothing)
        values = {'data_root': self.train_data, 'save_root': self.runs / 'checkpoints', 'name': name, 'steps': steps,
                  'warmup': f'{steps // 10}ba', **s.overrides, **variables}
        return [f'variables.{key}={value}' for key, value in values.items()] + [
            f'global_train_batch_size={s.batch}', f'device_train_microbatch_size={s.microbatch}',
            f'device={"gpu" if s.device == "cuda" else "cpu"}', f'seed={s.seed if seed is None else seed}']

    def train(self, name: str, recipe: str, steps: int, seed: int | None = None, fsdp: bool = False,
              then=None, extra: Sequence[str] = (), keep_model: bool = True, **variables) -> dict:
        """The stage ``name``: one recipe run of ``steps`` batches (``seed``, default the bench's, also orders the
        batches drawn), exported to ``<stage>/hf`` (unless ``keep_model`` is false), its checkpoints removed after.
        The result has the export, the tokens trained, a digest of each batch and, when the run evaluated
        (``extra``: more overrides, such as an ``eval_loader``), its ``eval_curve``; ``then(trainer, out)`` adds to
        it. ``fsdp`` keeps the recipe's FSDP2 (one rank)."""
        overrides = self.overrides(name, steps, seed, **variables) + list(extra)

        def build(out: Path) -> dict:
            batches = BatchDigests()
            trainer, config, history = train_stage(recipe, overrides, None, extra_callbacks=[batches], fsdp=fsdp)
            save_folder = Path(config.save_folder.format(run_name=config.run_name))
            (out / 'history.json').write_text(json.dumps(history))
            result = {'tokens': train_tokens(config, self.settings.seq_len), 'batch_digests': batches.digests,
                      **(then(trainer, out) if then else {})}
            if keep_model:
                result['hf_folder'] = str(export_hf(save_folder, out / 'hf', overwrite=True))
            if history['eval']:
                result['eval_curve'] = mean_eval_curve(history)
            shutil.rmtree(save_folder, ignore_errors=True)
            return result

        return self.stage(self.runs, name, build, recipe=recipe_path(recipe).read_text(), overrides=overrides,
                          fsdp=fsdp, **({} if keep_model else {'keep_model': False}))

    def ct(self, name: str, model: str, batches: int | None = None, seed: int | None = None) -> dict:
        """The stage ``<name>-ct``: continued pre-training of ``model`` (``yamls/real/ct.yaml``), the whole budget by
        default."""
        return self.train(f'{name}-ct', 'real/ct.yaml', batches or self.batches, seed, model_path=model)

    def ct_after_fusion(self, name: str, fused: str, batches: int) -> dict:
        """CT of a baked Fusion for the rest of the budget, on its own seed: Fusion drew the first batches of the
        stream with the bench seed, and CT restarting the stream with that seed would replay them."""
        return self.ct(name, fused, batches, self.settings.seed + 100)

    def evaluate(self, label: str, method: str, budget: str | None, hf: str | Path, tokens: int, build_seconds: float,
                 intermediate: bool = False, **extra) -> dict:
        """One row: the model's held-out loss and task accuracies. ``intermediate``: a row that ranks no method (refit,
        attention transfer, DHA after Fusion), scored on ``intermediate_limit`` documents a task, the first of the
        ranking rows' sample, and marked so."""
        s = self.settings
        key = re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')
        documents = s.intermediate_limit if intermediate else s.limit

        def build(out: Path) -> dict:
            # a seeded random sample of each task's split, the same documents for every row (paired comparisons)
            result = run_eval(hf, tasks=list(s.tasks), num_fewshot=0, documents=documents, include=s.include, out=out,
                              batch_size=s.eval_batch_size, device=s.device, name=label, data=self.heldout,
                              train_tokens=tokens, seed=s.seed)
            accuracy = {}
            metric = {}
            for task in s.tasks:
                picked = headline(result['scores'].get(task, {}))
                accuracy[task] = picked[1] if picked else None
                metric[task] = picked[0] if picked else None
            return {'val_loss': result['val_loss'], 'accuracy': accuracy, 'metric': metric,
                    'val_loss_ci95': result.get('val_loss_ci95'), 'documents_file': str(out / DOCUMENTS_FILE),
                    'kv_bytes': result['kv_cache_bytes_per_4096_tokens'], 'model_type': result['model_type'],
                    'task_data': {task: {k: v for k, v in data.items() if k in ('split', 'lm_eval_split', 'data', 'note')}
                                  for task, data in result.get('task_data', {}).items()}}

        scored = self.stage(self.evals, key, build, model=hf, tasks=list(s.tasks), include=list(map(str, s.include)),
                            limit=documents, eval_batch_size=s.eval_batch_size, heldout=self.heldout, seed=s.seed)
        values = [v for v in scored['accuracy'].values() if v is not None]
        row = {'label': label, 'method': method, 'budget': budget, 'tokens': tokens, 'val_loss': scored['val_loss'],
               'accuracy': scored['accuracy'], 'metric': scored['metric'],
               'mean_accuracy': sum(values) / len(values) if values else None, 'kv_bytes': scored['kv_bytes'],
               'kv_fraction_of_source': scored['kv_bytes'] / self.teacher_kv_bytes if self.rows else 1.0,
               'model_type': scored['model_type'], 'wall_s': round(build_seconds, 1), 'eval_s': scored['seconds'],
               'hf_folder': str(hf), 'val_loss_ci95': scored.get('val_loss_ci95'),
               'documents_file': scored.get('documents_file'), 'documents_per_task': documents,
               'evaluation': 'intermediate' if intermediate else 'ranking', **extra}
        if not self.task_data and scored.get('task_data'):
            self.task_data.update(scored['task_data'])
        self.rows.append(row)
        return row

    @property
    def teacher_kv_bytes(self) -> int:
        return self.rows[0]['kv_bytes']

    def calibration(self, settings) -> dict:
        """A conversion's settings as its stage reads them (every field of its settings dataclass)."""
        return {'settings': asdict(settings), 'kind': type(settings).__name__}

    # --- healing: refit, attention transfer, KL ----------------------------------------------------------------
    def heal(self, name: str, label: str, method: str, budget: str, converted: str | Path, seconds: float,
             refit=None, **extra) -> None:
        """The healing rows of one 0-token conversion: refit (0 training tokens; ``refit``, a (build, reads) pair,
        builds it where ``dha-train refit`` does not apply; ``False``: no refit, for MoH, which pools no K/V head),
        then attention transfer and KL distillation, which together train on as many tokens as the method's CT row.
        Both train on ``launch/heal.sh``'s recipes, in one process without FSDP2 (see ``transfer``)."""
        if not self.settings.heal:
            return
        s = self.settings
        # at least one batch each, and together the CT row's batches (when it has two or more)
        transfers = transfer_batches(s, self.batches)
        kl_batches = max(1, self.batches - transfers)
        converted_s, start = seconds, str(converted)
        if refit is not False:
            refitted = self.refit(name, converted) if refit is None else self.stage(
                self.runs, f'{name}-refit', refit[0], model=converted, **refit[1])
            seconds += refitted['seconds']
            start = refitted['hf_folder']
        kl_rows = [f'+KL {tokens_label(point)}' for point in s.heal_points] or ['+KL']
        if self._same_healing(label, method, budget, start, ['+refit'] * (refit is not False) + ['+transfer', *kl_rows],
                              **extra):
            return
        if refit is not False:
            self.evaluate(f'{label} +refit', method, budget, start, 0, seconds, intermediate=True, stage='refit',
                          stage_s=refitted['seconds'], **extra)
        transferred = self.transfer(name, start, transfers)
        seconds += transferred['seconds']
        self.evaluate(f'{label} +transfer', method, budget, transferred['hf_folder'], transferred['tokens'], seconds,
                      intermediate=True, stage='transfer', lr=s.transfer_lr, stage_s=transferred['seconds'], **extra)
        if s.heal_points:
            self._recovery_points(name, label, method, budget, transferred, seconds, seconds - converted_s, **extra)
            return
        distilled = self.distil(name, transferred['hf_folder'], kl_batches)
        seconds += distilled['seconds']
        self.evaluate(f'{label} +KL', method, budget, distilled['hf_folder'],
                      transferred['tokens'] + distilled['tokens'], seconds, stage='kl', lr=s.kl_lr,
                      stage_s=distilled['seconds'], **extra)

    def _recovery_points(self, name: str, label: str, method: str, budget: str, transferred: dict, seconds: float,
                         healing_s: float, **extra) -> None:
        """KL from the transfer to each of ``heal_points`` healing tokens, each point its own stage from the previous
        point's export, on batches of its own seed (no point replays another's), with the recipe's warm-up and
        cosine over the point's own batches; each point a ranking row with its healing seconds so far."""
        s = self.settings
        start, tokens = transferred['hf_folder'], transferred['tokens']
        for index, point in enumerate(s.heal_points):
            batches = (point - tokens) // (s.batch * s.seq_len)
            distilled = self.distil(name, start, batches, seed=s.seed + 102 + 1000 * index, stage=f'kl-to-{point}')
            seconds += distilled['seconds']
            healing_s += distilled['seconds']
            tokens += distilled['tokens']
            start = distilled['hf_folder']
            self.evaluate(f'{label} +KL {tokens_label(point)}', method, budget, start, tokens, seconds, stage='kl',
                          lr=s.kl_lr, stage_s=distilled['seconds'], healing_tokens=tokens,
                          healing_s=round(healing_s, 1), **extra)

    def _same_healing(self, label: str, method: str, budget: str | None, start: str, stages: list[str],
                      **extra) -> bool:
        """Whether an earlier healing chain started from the same model (its weights, config and tokenizer): then its
        rows are this chain's, recorded ``same_as`` them (ranked once), and no stage trains it again. Aligned GQA at
        one group refits to mean-pool's very weights, and the same start and seeds heal to the same model."""
        digest = folder_digest(start, skip=('README.md', REFIT_REPORT))
        earlier = self.healing_starts.setdefault(digest, label)
        if earlier == label:
            return False
        rows = {row['label']: row for row in self.rows}
        if any(f'{earlier} {stage}' not in rows for stage in stages):
            return False
        for stage in stages:
            row = rows[f'{earlier} {stage}']
            self.rows.append({**row, **extra, 'label': f'{label} {stage}', 'method': method, 'budget': budget,
                              'same_as': row['label'],
                              'note': f'healed from the same model as {earlier} (the same weights): its figures'})
        say(f'{label}: heals from the same model as {earlier}; its rows are reused')
        return True

    def refit(self, name: str, converted: str | Path, seed: int | None = None) -> dict:
        """The stage ``<name>-refit``: ``dha-train refit`` of a 0-token conversion against the source, on
        ``refit_tokens`` calibration tokens drawn with ``seed`` (default the bench's)."""
        s = self.settings
        settings = RefitSettings(data=str(self.train_data), tokens=s.refit_tokens,
                                 seed=s.seed if seed is None else seed, device=s.device)

        def build(out: Path) -> dict:
            report = refit_folder(self.source, converted, out / 'hf', settings, overwrite=True)
            return {'hf_folder': str(out / 'hf'), 'calibration_tokens': s.refit_tokens,
                    **{key: value for key, value in report.items() if key.startswith('mean_')}}
        return self.stage(self.runs, f'{name}-refit', build, model=converted, **self.calibration(settings))

    # Each healing stage draws its batches with its own seed (the bench's + 101, + 102 by default), so KL does not
    # replay the transfer's batches. Both train in one process without FSDP2: the same loss curve as FSDP2 over one
    # rank, faster (`dha-train bench healing-speed`: attention transfer then back-propagates each layer's MSE within
    # the layer and computes no logits); launch/heal.sh's FSDP2 path is tested by the launch tests.
    def transfer(self, name: str, model: str | Path, batches: int, seed: int | None = None) -> dict:
        """The stage ``<name>-transfer``: layer-wise attention transfer of ``model`` to the source."""
        s = self.settings
        return self.train(f'{name}-transfer', 'real/transfer.yaml', batches, s.seed + 101 if seed is None else seed,
                          model_path=model, source_path=self.source, lr=s.transfer_lr)

    def distil(self, name: str, model: str | Path, batches: int, seed: int | None = None, stage: str = 'kl') -> dict:
        """The stage ``<name>-<stage>``: logit (KL) distillation of ``model`` from the source."""
        s = self.settings
        return self.train(f'{name}-{stage}', 'real/kl.yaml', batches, s.seed + 102 if seed is None else seed,
                          model_path=model, source_path=self.source, lr=s.kl_lr)


def tokens_label(tokens: int) -> str:
    """A recovery point's healing tokens as its row label gives them: 32K, 1024K, or the count where not whole K."""
    return f'{tokens // 1024}K' if tokens % 1024 == 0 else str(tokens)


def model_config(folder: Path):
    from dha_train.model_folders import load_model_config

    return load_model_config(folder, who='bench real')
