"""lm-eval's HF model with each multiple-choice context computed once: ``ContextCachedLM``.

lm-eval's ``HFLM`` scores a multiple-choice document by running the model over context + choice once per choice, and
computes the LM head and a log-softmax over the whole vocabulary at every position of the padded batch. On SmolLM2
on 2 CPU cores the model's forward is over 90% of evaluation time (``dha-train bench eval-speed`` measures it), and
most of its tokens are contexts repeated once per choice (sciq's support paragraph four times).

``ContextCachedLM`` gives the same log-likelihoods from less work: requests that share a context (the choices of one
document) run the context once, keep its KV cache (transformers' own ``DynamicCache``), and score every choice from
that cache in one batch; the LM head and log-softmax run only at the positions that predict continuation tokens. What
is computed is the same function of the same tokens, so each log-likelihood agrees with ``HFLM``'s to float rounding
(``tests/test_context_cache_lm.py``: within 1e-4 per document, identical choices). Requests ``HFLM`` would truncate
(context + continuation longer than the model's window) go to ``HFLM``'s own path unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm
from transformers import DynamicCache

Request = tuple[tuple[str, str], list[int], list[int]]
# A batch of contexts holds at most batch size x this many padded tokens: context lengths are heavy-tailed (sciq's
# support paragraphs run from 16 to 467 tokens on SmolLM2), so a fixed count of contexts padded to the longest
# would spend most of its time on padding.
TOKENS_PER_ROW = 64


def _batches(items: list, length, rows: int, tokens: int):
    """Consecutive runs of ``items`` (longest first by ``length``) of at most ``rows`` items and ``tokens`` padded
    tokens (an item longer than ``tokens`` goes alone)."""
    batch: list = []
    for item in items:
        if batch and (len(batch) == rows or (len(batch) + 1) * length(batch[0]) > tokens):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def _worth_sharing(context: tuple[int, ...], continuations: list[list[int]]) -> bool:
    """Run the context once for its continuations when that saves at least half their tokens: the repeated
    contexts saved against a second, padded pass over the continuations (arc, sciq and hellaswag share; piqa's short
    goals before long solutions and winogrande's one context per choice do not)."""
    return len(continuations) > 1 and (len(continuations) - 1) * len(context) >= sum(map(len, continuations)) / 2


class ContextCachedLM(HFLM):
    """``HFLM`` whose log-likelihood requests share each context's forward pass (see the module docstring)."""

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        if self.backend != 'causal':
            return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        # an empty continuation has no token to predict: (0.0, True), as HFLM answers it beside a one-token one
        empty = [i for i, (_, _, continuation) in enumerate(requests) if not continuation]
        for i in empty:
            results[i] = (0.0, True)
            if requests[i][0] is not None:
                self.cache_hook.add_partial('loglikelihood', requests[i][0], results[i])
        too_long = [i for i, (_, context, continuation) in enumerate(requests)
                    if continuation and len(context) + len(continuation) > self.max_length + 1]
        if too_long:  # HFLM truncates these from the left; its own path keeps that behaviour exactly
            for i, answer in zip(too_long, super()._loglikelihood_tokens([requests[i] for i in too_long],
                                                                         disable_tqdm=True, override_bs=override_bs)):
                results[i] = answer
        groups: dict[tuple[int, ...], list[int]] = {}
        skipped = set(too_long) | set(empty)
        for i, (_, context, _) in enumerate(requests):
            if i not in skipped:
                groups.setdefault(tuple(context), []).append(i)
        shared = {context: members for context, members in groups.items() if _worth_sharing(
            context, [requests[i][2] for i in members])}
        alone = sorted((i for context, members in groups.items() if context not in shared for i in members),
                       key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        batch = self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 16
        progress = tqdm(total=len(requests) - len(skipped), disable=disable_tqdm or self.rank != 0,
                        desc='Running loglikelihood requests (contexts shared)')

        def done(indices: list[int], answers: list[tuple[float, bool]]) -> None:
            for i, answer in zip(indices, answers):
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial('loglikelihood', requests[i][0], answer)
            progress.update(len(indices))

        ordered = sorted(shared, key=len, reverse=True)  # longest first: memory peaks early, similar lengths pad less
        for contexts in _batches(ordered, len, rows=batch, tokens=batch * TOKENS_PER_ROW):
            done([i for context in contexts for i in shared[context]],
                 self._score(contexts, [[requests[i][2] for i in shared[context]] for context in contexts]))
        for chunk in _batches(alone, lambda i: len(requests[i][1]) + len(requests[i][2]) - 1, rows=batch,
                              tokens=batch * TOKENS_PER_ROW):
            done(chunk, self._score_whole([requests[i][1] for i in chunk], [requests[i][2] for i in chunk]))
        progress.close()
        return results  # type: ignore[return-value]

    def _score_whole(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """``_score``'s answers for requests that share no context: context and continuation in one right-padded
        batch, as HFLM runs them, with the LM head only where a continuation token is predicted."""
        device = self.device
        sequences = [(context + tokens)[:-1] for context, tokens in zip(contexts, continuations)]
        width = max(len(sequence) for sequence in sequences)
        inputs = torch.tensor([q + [q[0]] * (width - len(q)) for q in sequences], dtype=torch.long, device=device)
        hidden = self.model.get_decoder()(input_ids=inputs, use_cache=False).last_hidden_state
        return self._answers([row[len(context) - 1:len(context) - 1 + len(tokens)]
                              for row, context, tokens in zip(hidden, contexts, continuations)], continuations)

    def _answers(self, hidden: list[torch.Tensor], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, greedy) of each continuation from the hidden states that predict its tokens:
        one LM-head product for the whole batch (the head's weights are read once, not once per request)."""
        log_probs = F.log_softmax(self.model.get_output_embeddings()(torch.cat(hidden)), dim=-1,
                                  dtype=self.softmax_dtype)
        wanted = torch.tensor([token for tokens in continuations for token in tokens], dtype=torch.long,
                              device=self.device)
        picked = log_probs.gather(1, wanted[:, None]).squeeze(1)
        greedy = log_probs.argmax(dim=-1) == wanted
        answers, start = [], 0
        for tokens in continuations:
            end = start + len(tokens)
            answers.append((float(picked[start:end].sum()), bool(greedy[start:end].all())))
            start = end
        return answers

    def _score(self, contexts: list[tuple[int, ...]], choices: list[list[list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, greedy) of every continuation in ``choices[g]`` after ``contexts[g]``, in that
        order. The contexts run once, right-padded in one batch. The continuations then run, longest first in batches
        of similar length, each over a copy of its context's cache rows at its context's positions, with the
        context's padding masked out (padding after a token never reaches it: attention is causal)."""
        model = self.model
        decoder = model.get_decoder()
        device = self.device
        lengths = torch.tensor([len(context) for context in contexts], device=device)
        width = int(lengths.max())
        context_ids = torch.tensor([list(c) + [c[0]] * (width - len(c)) for c in contexts], dtype=torch.long,
                                   device=device)
        context_mask = (torch.arange(width, device=device)[None] < lengths[:, None]).long()
        out = decoder(input_ids=context_ids, attention_mask=context_mask, use_cache=True)
        last_hidden = out.last_hidden_state[torch.arange(len(contexts), device=device), lengths - 1]
        context_cache = out.past_key_values.to_legacy_cache() if hasattr(out.past_key_values, 'to_legacy_cache') \
            else out.past_key_values
        flat = [(g, tokens) for g, group in enumerate(choices) for tokens in group]
        answers: list[tuple[float, bool] | None] = [None] * len(flat)
        order = sorted(range(len(flat)), key=lambda i: -len(flat[i][1]))
        budget = len(contexts) * TOKENS_PER_ROW
        start = 0
        while start < len(order):  # continuation batches of at most ``budget`` padded tokens
            longest = len(flat[order[start]][1])
            count = max(1, min(len(order) - start, budget // max(longest, 1)))
            chunk = order[start:start + count]
            start += count
            rows = torch.tensor([flat[i][0] for i in chunk], device=device)
            continuations = [flat[i][1] for i in chunk]
            hidden = last_hidden[rows][:, None]  # predicts each continuation's first token
            if longest > 1:
                cache = DynamicCache.from_legacy_cache(tuple((key[rows], value[rows]) for key, value in context_cache))
                inputs = torch.tensor([t[:-1] + [t[0]] * (longest - len(t)) for t in continuations], dtype=torch.long,
                                      device=device)
                steps = torch.arange(longest - 1, device=device)
                mask = torch.cat([context_mask[rows], torch.ones_like(inputs)], dim=1)
                following = decoder(input_ids=inputs, attention_mask=mask, past_key_values=cache, use_cache=True,
                                    position_ids=lengths[rows][:, None] + steps[None],
                                    cache_position=width + steps).last_hidden_state
                hidden = torch.cat([hidden, following], dim=1)
            for i, answer in zip(chunk, self._answers([row[:len(tokens)] for row, tokens in zip(hidden, continuations)],
                                                      continuations)):
                answers[i] = answer
        return answers  # type: ignore[return-value]
