"""transformers / PEFT features on a HypeNet export, run in a fresh process where halo_dist cannot
be imported.

``python hf_export_checks.py EXPORT WORK_DIR RESULTS.json`` runs every check of ``CHECKS`` (in
order) and writes ``{name: "ok" | traceback}``; tests/test_hf_export.py asserts on it. Each check
compares ``generate`` with a reference written here: decoding by full-prefix forwards without a
cache, the logits processors implemented from their definitions, and a plain beam search over
unbatched prompts.

The export (tests/test_hf_export.py builds it) is a tiny converted byte-vocabulary model whose
teacher shipped a chat template and a generation_config.json (``TEACHER_GENERATION``).
"""

import json
import sys
import traceback

CHECKS = {}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
TEACHER_GENERATION = {"max_new_tokens": 5, "repetition_penalty": 1.3}  # + the tokenizer's eos / pad


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------------------- references
def next_scores(m, rows):
    """Next-token logits ``[B, V]`` (fp32, as generate scores them) from a forward over the whole
    prefix."""
    import torch

    with torch.no_grad():
        return m(rows).logits[:, -1].float()


def reference(m, prompt, new, process=None, eos=None, sample=False, rows=1, pad=None):
    """``rows`` copies of ``prompt`` decoded ``new`` tokens without a cache: scores ->
    ``process(ids, scores)`` -> argmax, or one multinomial draw over all rows; a row that produced
    ``eos`` continues with ``pad``."""
    import torch

    ids = prompt[None].repeat(rows, 1)
    done = torch.zeros(rows, dtype=torch.bool)
    for _ in range(new):
        scores = next_scores(m, ids)
        if process is not None:
            scores = process(ids, scores)
        tok = torch.multinomial(scores.softmax(-1), 1)[:, 0] if sample else scores.argmax(-1)
        if eos is not None:
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            done = done | (tok == eos)
        ids = torch.cat([ids, tok[:, None]], 1)
        if bool(done.all()):
            break
    return ids


def repetition_penalty(penalty):
    """Every token already in the sequence: positive scores divided by ``penalty``, negative ones
    multiplied."""
    def process(ids, scores):
        scores = scores.clone()
        for b, row in enumerate(ids.tolist()):
            for t in set(row):
                scores[b, t] = (scores[b, t] / penalty if scores[b, t] > 0
                                else scores[b, t] * penalty)
        return scores
    return process


def no_repeat_ngram(n):
    """A token that would complete an n-gram the sequence already holds is banned."""
    def process(ids, scores):
        scores = scores.clone()
        for b, row in enumerate(ids.tolist()):
            tail = tuple(row[len(row) - n + 1:])
            for i in range(len(row) - n + 1):
                if tuple(row[i:i + n - 1]) == tail:
                    scores[b, row[i + n - 1]] = float("-inf")
        return scores
    return process


def bad_words(words):
    """A word's last token is banned when the sequence ends with the rest of the word."""
    def process(ids, scores):
        scores = scores.clone()
        for b, row in enumerate(ids.tolist()):
            for w in words:
                if len(w) == 1 or row[len(row) - len(w) + 1:] == w[:-1]:
                    scores[b, w[-1]] = float("-inf")
        return scores
    return process


def min_new_tokens(k, eos, prompt_len):
    def process(ids, scores):
        if ids.shape[1] - prompt_len < k:
            scores = scores.clone()
            scores[:, eos] = float("-inf")
        return scores
    return process


def temperature_top_k(temperature, k):
    def process(ids, scores):
        scores = scores / temperature
        kth = scores.topk(k, dim=-1).values[:, -1:]
        return scores.masked_fill(scores < kth, float("-inf"))
    return process


def ban_odd(ids, scores):
    """A user's logits processor: odd token ids are never generated."""
    scores = scores.clone()
    scores[:, 1::2] = float("-inf")
    return scores


def reference_beam_search(m, prompt, num_beams, new, keep):
    """Beam search over one prompt by full-prefix forwards: each step every beam's ``num_beams``
    best tokens are candidates, the ``num_beams`` best cumulative log-probabilities survive; no EOS,
    so every beam runs ``new`` tokens and its score is the sum over ``new`` (length penalty 1). ->
    ``[(score, tokens)]``, best first."""
    import torch
    import torch.nn.functional as F

    beams = [(0.0, prompt.tolist())]
    for _ in range(new):
        candidates = []
        for score, seq in beams:
            logp = F.log_softmax(next_scores(m, torch.tensor([seq])), -1)[0]
            top = logp.topk(num_beams)
            candidates += [(score + v, seq + [t]) for v, t in zip(top.values.tolist(),
                                                                  top.indices.tolist())]
        beams = sorted(candidates, key=lambda c: -c[0])[:num_beams]
    return [(score / new, seq[len(prompt):]) for score, seq in beams[:keep]]


def left_pad(prompts, pad):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    return ids, mask


# --------------------------------------------------------------------------------------- the checks
@check
def tokenizer_loads_without_running_model_code(ctx):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ctx["export"], trust_remote_code=False)
    assert tok.chat_template == CHAT_TEMPLATE, tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<user>hi\n", text
    assert not [name for name in sys.modules
                if "hypenet" in name], "the tokenizer imported the model code"


@check
def forward_returns_a_model_output_unless_config_says_tuples(ctx):
    from transformers.utils import ModelOutput

    m, x = ctx["model"], ctx["prompt"][None]
    out = m(x, labels=x)
    assert isinstance(out, ModelOutput) and out.loss is not None and out.logits.shape[:2] == x.shape
    m.config.return_dict = False
    try:
        loss, logits = m(x, labels=x)
    finally:
        m.config.return_dict = True
    assert logits.shape == out.logits.shape


@check
def model_generation_config_defaults_apply(ctx):
    """The export's generation_config.json is the teacher's: no arguments decode with its
    settings."""
    m, p = ctx["model"], ctx["prompt"]
    try:
        assert m.generation_config.repetition_penalty == TEACHER_GENERATION["repetition_penalty"]
        got = m.generate(p[None])
    finally:
        m.generation_config.repetition_penalty = 1.0  # the other checks start from neutral defaults
    want = reference(m, p, TEACHER_GENERATION["max_new_tokens"], repetition_penalty(1.3),
                     eos=ctx["eos"], pad=ctx["pad"])
    assert got.tolist() == want.tolist(), (got, want)


@check
def generation_config_object_with_no_repeat_ngram_size(ctx):
    from transformers import GenerationConfig

    import torch

    m = ctx["model"]
    # a random model seldom repeats itself: the first prompt of one repeated token whose greedy
    # continuation completes a bigram already present, so the ban changes the output
    for t in range(3, 250):
        p = torch.full((6,), t)
        want = reference(m, p, 12, no_repeat_ngram(2))
        if want.tolist() != reference(m, p, 12).tolist():
            break
    else:
        raise AssertionError("no prompt made the model repeat a bigram: the check proves nothing")
    got = m.generate(p[None],
                     generation_config=GenerationConfig(max_new_tokens=12, no_repeat_ngram_size=2,
                                                        eos_token_id=[], pad_token_id=ctx["pad"]))
    assert got.tolist() == want.tolist(), (got, want)


@check
def repetition_penalty_kwarg(ctx):
    m, p = ctx["model"], ctx["prompt"]
    got = m.generate(p[None], max_new_tokens=10, repetition_penalty=1.8, eos_token_id=[])
    want = reference(m, p, 10, repetition_penalty(1.8))
    assert got.tolist() == want.tolist(), (got, want)
    assert want.tolist() != reference(m, p, 10).tolist()


@check
def bad_words_ids(ctx):
    m, p = ctx["model"], ctx["prompt"]
    plain = reference(m, p, 8)[0, len(p):].tolist()
    words = [[plain[0]], [plain[2], plain[3]]]
    got = m.generate(p[None], max_new_tokens=8, bad_words_ids=words, eos_token_id=[])
    want = reference(m, p, 8, bad_words(words))
    assert got.tolist() == want.tolist(), (got, want)
    assert want[0, len(p)] != plain[0]


@check
def min_new_tokens_hold_back_eos(ctx):
    m, p, pad = ctx["model"], ctx["prompt"], ctx["pad"]
    # what greedy says first becomes the EOS: it would stop at once
    eos = reference(m, p, 1)[0, -1].item()
    got = m.generate(p[None], max_new_tokens=8, min_new_tokens=3, eos_token_id=eos,
                     pad_token_id=pad)
    want = reference(m, p, 8, min_new_tokens(3, eos, len(p)), eos=eos, pad=pad)
    assert got.tolist() == want.tolist(), (got, want)
    assert got.shape[1] >= len(p) + 3


@check
def user_logits_processor(ctx):
    from transformers import LogitsProcessor, LogitsProcessorList

    class BanOdd(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return ban_odd(input_ids, scores)

    m, p = ctx["model"], ctx["prompt"]
    got = m.generate(p[None], max_new_tokens=8, logits_processor=LogitsProcessorList([BanOdd()]),
                     eos_token_id=[])
    want = reference(m, p, 8, ban_odd)
    assert got.tolist() == want.tolist() and all(t % 2 == 0
                                                 for t in got[0, len(p):].tolist()), (got, want)


@check
def sampling_with_temperature_top_k_and_num_return_sequences(ctx):
    import torch

    m, p = ctx["model"], ctx["prompt"]
    torch.manual_seed(11)
    got = m.generate(p[None], do_sample=True, temperature=0.7, top_k=20, num_return_sequences=3,
                     max_new_tokens=8, eos_token_id=[])
    torch.manual_seed(11)
    want = reference(m, p, 8, temperature_top_k(0.7, 20), sample=True, rows=3)
    assert got.shape == (3, len(p) + 8) and got.tolist() == want.tolist(), (got, want)
    assert len({tuple(r) for r in got.tolist()}) > 1, "three identical samples"


@check
def stop_strings(ctx):
    from transformers import AutoTokenizer

    m, p = ctx["model"], ctx["prompt"]
    tok = AutoTokenizer.from_pretrained(ctx["export"], trust_remote_code=False)
    seq = reference(m, p, 16)[0].tolist()
    gen, n = seq[len(p):], len(p)
    printable = [32 < t < 127 for t in gen]
    # the first printable pair (else character) ending at a new token that the text before it does
    # not hold: decoding stops right after that token
    pairs = [j for j in range(1, len(gen)) if printable[j - 1] and printable[j]
             and bytes(gen[j - 1:j + 1]) not in bytes(t if t < 256 else 0 for t in seq[:n + j])]
    singles = [j for j in range(len(gen)) if printable[j] and gen[j] not in gen[:j]]
    assert pairs or singles, f"nothing printable in {gen}"
    j = pairs[0] if pairs else singles[0]
    stop = bytes(gen[j - 1:j + 1] if pairs else gen[j:j + 1]).decode()
    got = m.generate(p[None], max_new_tokens=16, stop_strings=[stop], tokenizer=tok,
                     eos_token_id=[])
    assert got[0, len(p):].tolist() == gen[:j + 1], (stop, got, gen)


@check
def streamer_receives_the_prompt_then_each_token(ctx):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    m, p = ctx["model"], ctx["prompt"]
    s = Collect()
    got = m.generate(p[None], max_new_tokens=6, streamer=s, eos_token_id=[])
    assert s.ended and s.puts[0] == [p.tolist()], s.puts
    assert [t for (t,) in s.puts[1:]] == got[0, len(p):].tolist(), (s.puts, got)


@check
def return_dict_in_generate_scores_logits_and_continue_from_its_cache(ctx):
    import torch

    m, p = ctx["model"], ctx["prompt"]
    out = m.generate(p[None], max_new_tokens=4, repetition_penalty=1.4, eos_token_id=[],
                     return_dict_in_generate=True, output_scores=True, output_logits=True)
    process = repetition_penalty(1.4)
    seq = p[None]
    for step in range(4):
        raw = next_scores(m, seq)
        assert torch.allclose(out.logits[step], raw, atol=1e-5), step
        assert torch.allclose(out.scores[step], process(seq, raw), atol=1e-5), step
        seq = torch.cat([seq, process(seq, raw).argmax(-1, keepdim=True)], 1)
    assert out.sequences.tolist() == seq.tolist()
    # the field's name before transformers' rename
    cache = out.cache if "cache" in out else out.past_key_values
    assert type(cache).__name__ == "HypeNetCache" and cache.get_seq_length() == seq.shape[1] - 1
    more = m.generate(out.sequences, cache=cache, max_new_tokens=3, eos_token_id=[])
    assert more.tolist() == reference(m, out.sequences[0], 3).tolist(), more


@check
def beam_search_on_left_padded_rows_equals_unbatched_reference(ctx):
    import torch

    m, pad = ctx["model"], ctx["pad"]
    prompts = [ctx["prompt"][:5], ctx["prompt2"]]
    ids, mask = left_pad(prompts, pad)
    width = ids.shape[1]
    for impl in (None, "static"):
        out = m.generate(ids, attention_mask=mask, num_beams=3, num_return_sequences=2,
                         max_new_tokens=5, eos_token_id=[], pad_token_id=pad,
                         return_dict_in_generate=True, output_scores=True,
                         cache_implementation=impl)
        for b, p in enumerate(prompts):
            want = reference_beam_search(m, p, num_beams=3, new=5, keep=2)
            for r, (score, tokens) in enumerate(want):
                row = 2 * b + r
                assert out.sequences[row, width:].tolist() == tokens, (impl, b, r,
                                                                       out.sequences[row], tokens)
                assert abs(out.sequences_scores[row].item() - score) < 1e-5, (impl, b, r)
    assert torch.equal(out.sequences[:, :width], ids.repeat_interleave(2, 0))


@check
def left_padded_greedy_batch_equals_each_row_alone_dynamic_and_static(ctx):
    m, pad = ctx["model"], ctx["pad"]
    prompts = [ctx["prompt"], ctx["prompt2"][:3], ctx["prompt2"]]
    ids, mask = left_pad(prompts, pad)
    width = ids.shape[1]
    dynamic = m.generate(ids, attention_mask=mask, max_new_tokens=7, eos_token_id=[],
                         pad_token_id=pad)
    static = m.generate(ids, attention_mask=mask, max_new_tokens=7, eos_token_id=[],
                        pad_token_id=pad, cache_implementation="static")
    assert static.tolist() == dynamic.tolist()
    for b, p in enumerate(prompts):
        assert dynamic[b, width:].tolist() == reference(m, p, 7)[0, len(p):].tolist(), b


@check
def peft_lora_fine_tune_saves_reloads_merges_and_generates(ctx):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    export, work = ctx["export"], ctx["work"]
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True),
                          LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                     target_modules=["q_proj", "v_proj"]))
    base_before = {k: v.clone() for k, v in lora.named_parameters() if "lora_" not in k}
    trained = [p for p in lora.parameters() if p.requires_grad]
    assert trained and len(trained) < len(base_before)
    opt = torch.optim.AdamW(trained, lr=2e-2)
    batch = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    lora.train()
    for _ in range(8):
        loss = lora(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(torch.equal(v, base_before[k])
               for k, v in lora.named_parameters() if "lora_" not in k)
    lora.eval()
    with torch.no_grad():
        tuned = lora(input_ids=batch).logits
    lora.save_pretrained(f"{work}/adapter")
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True),
        f"{work}/adapter").eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=batch).logits, tuned, atol=1e-5)
        merged = reloaded.merge_and_unload()
        assert torch.allclose(merged(batch).logits, tuned, atol=1e-4)
    p = ctx["prompt"]
    got = lora.generate(input_ids=p[None], max_new_tokens=5, eos_token_id=[],
                        pad_token_id=ctx["pad"])
    assert got.tolist() == reference(merged, p, 5).tolist(), got


def main(export: str, work: str, results_path: str) -> None:
    sys.modules["halo_dist"] = None  # any import of halo_dist fails: the export must stand alone
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ctx = {"export": export, "work": work, "prompt": torch.randint(3, 250, (7,), generator=gen),
           "prompt2": torch.randint(3, 250, (9,), generator=gen)}
    results = {}
    for name, fn in CHECKS.items():
        if name != "tokenizer_loads_without_running_model_code" and "model" not in ctx:
            m = ctx["model"] = AutoModelForCausalLM.from_pretrained(
                export, trust_remote_code=True).double().eval()
            ctx["eos"], ctx["pad"] = (m.generation_config.eos_token_id,
                                      m.generation_config.pad_token_id)
        try:
            fn(ctx)
            results[name] = "ok"
        except Exception:  # every check reports, so one failure does not hide the others
            results[name] = traceback.format_exc()
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
