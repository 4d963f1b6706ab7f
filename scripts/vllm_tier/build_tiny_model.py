"""Build a tiny random Qwen2 model (tokenizer + weights + chat template) for the vLLM tier.

No model can be downloaded on these machines, so the integration tier makes its own:

* a byte-level BPE tokenizer (vocab 2048) trained with `tokenizers` on generated text, with
  Qwen's special tokens (<|endoftext|>, <|im_start|>, <|im_end|> as special tokens) and its
  tool / reasoning markers (<tool_call>, </tool_call>, <tools>, </tools>, <tool_response>,
  </tool_response>, <think>, </think>) as regular added tokens, as Qwen ships them;
* a 2-layer Qwen2ForCausalLM (hidden 128, 2 heads of 64, random weights, fixed seed), float32;
* a Hermes/Qwen-style chat template: tools in <tools>, tool calls as <tool_call>{json}</tool_call>,
  tool results in <tool_response>, assistant reasoning in <think>, add_generation_prompt.

The text the model generates is random junk by design; the shapes are what the tests check.

Run with the vLLM venv's python (it has torch, transformers and tokenizers):
    .venv-vllm/bin/python scripts/vllm_tier/build_tiny_model.py OUT_DIR
It writes OUT_DIR/.complete last; an existing complete OUT_DIR is left alone unless --force.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen marks these as added but not "special" (they survive skip_special_tokens, so the
# tool-call and reasoning parsers see them in the decoded text).
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tools>", "</tools>",
                 "<tool_response>", "</tool_response>", "<think>", "</think>"]

DEFAULT_SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part.text is defined and part.text is not none -%}{{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- else %}
        {{- '""" + DEFAULT_SYSTEM + r"""\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\n""" + DEFAULT_SYSTEM + r"""<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or message.role == 'developer' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is defined and message.reasoning_content else (message.reasoning if message.reasoning is defined and message.reasoning else '') %}
        {%- if reasoning %}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' }}
        {%- endif %}
        {{- render_content(message.content) }}
        {%- if message.tool_calls is defined and message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

WORDS = (
    "the a an of to in on for with and or but not is are was be been have has do does what who "
    "where when why how which weather city time today tomorrow paris london tokyo berlin rome "
    "temperature sunny cloudy rain snow wind degrees celsius fahrenheit hello world hi thanks please "
    "you are a helpful assistant answer question user system tool function call result response "
    "name arguments type object string number integer boolean array properties required enum "
    "description get set search read write file code python json schema value key list item "
    "model token tokens prompt output input reasoning think step first then finally because "
    "number one two three four five six seven eight nine ten hundred thousand yes no maybe ok "
    "error status done failed completed incomplete cached length stop"
).split()


def _sentence(rng: random.Random) -> str:
    n = rng.randint(3, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2000)))
    s = " ".join(words)
    return s[0].upper() + s[1:] + rng.choice([".", "?", "!", ",", ":"])


def _json_blob(rng: random.Random) -> str:
    obj = {rng.choice(WORDS): rng.choice([rng.choice(WORDS), rng.randint(0, 999), True, None,
                                          [rng.choice(WORDS), rng.randint(0, 9)]])
           for _ in range(rng.randint(1, 5))}
    return json.dumps(obj)


def corpus(seed: int = 0, n: int = 6000):
    rng = random.Random(seed)
    for _ in range(n):
        kind = rng.random()
        if kind < 0.05:
            yield "Hello! I am a tiny test model. Let me think about it"
        elif kind < 0.55:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        elif kind < 0.8:
            yield _json_blob(rng)
        elif kind < 0.9:
            args = json.dumps({"city": rng.choice(WORDS), "unit": rng.choice(["c", "f"])})
            yield f'<tool_call>\n{{"name": "get_{rng.choice(WORDS)}", "arguments": {args}}}\n</tool_call>'
        else:
            yield f"<|im_start|>{rng.choice(['system', 'user', 'assistant'])}\n{_sentence(rng)}<|im_end|>\n"


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


REASONING_TEXT = "Let me think about it"
CONTENT_TEXT = "Hello! I am a tiny test model."


def _chain_ids(tokenizer) -> dict:
    """Token ids of the scripted answer: reasoning words, </think>, content words, <|im_end|>."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    reasoning = enc(REASONING_TEXT)
    content = enc(CONTENT_TEXT)
    # The last prompt token with thinking on ("...assistant\n") and off ("...</think>\n\n").
    think_on = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    think_off = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    start_on = enc(think_on)[-1]
    start_off = enc(think_off)[-1]
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chain = [start_on, *reasoning, think_end, *content, eos]
    sources = chain[:-1]
    if start_off != start_on:
        sources_off = [start_off]
    else:
        sources_off = []
    if len(set(sources + sources_off)) != len(sources) + len(sources_off):
        raise SystemExit(f"scripted answer reuses a token, pick other words: {chain} / {start_off}")
    transitions = list(zip(chain[:-1], chain[1:]))
    if sources_off:
        transitions.append((start_off, content[0]))
    return {"transitions": transitions, "reasoning": reasoning, "content": content,
            "start_on": start_on, "start_off": start_off}


def build(out_dir: str, *, seed: int = 0, vocab_size: int = 2048, hidden: int = 128,
          layers: int = 2, heads: int = 2, kv_heads: int = 1, max_pos: int = 4096) -> None:
    """Random Qwen2 weights, except the embeddings and LM head, which are laid out so that

    * logits ~= bias[next] + transition(current token -> next) + noise(current, next): the model is
      (almost exactly) a bigram model, the two random transformer layers adding a tiny perturbation;
    * a scripted transition chain with a +30 logit margin makes every unconstrained answer
      "<reasoning: Let me think about it></think>Hello! I am a tiny test model.<|im_end|>"
      (deterministic in practice even when sampling at temperature 1, and it stops by itself);
    * elsewhere (under a grammar: tool calls, json_schema) the next token is random among the
      allowed ones (noise std ~1), with <|im_end|> favoured (+5) so a finished grammar ends the turn,
      and tokens holding '"' (+4) or '}' (+2) favoured so JSON strings and objects close quickly.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    tokenizer = build_tokenizer(vocab_size, seed)
    n_vocab = len(tokenizer)
    padded_vocab = (n_vocab + 63) // 64 * 64
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + MARKER_TOKENS}
    chain = _chain_ids(tokenizer)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=padded_vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_pos,
        max_window_layers=layers,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.eval()

    # Hidden dims: 0 = constant bias channel, 1..n_chain = one per scripted source token, rest = noise.
    transitions = chain["transitions"]
    n_chain = len(transitions)
    noise_lo = 1 + n_chain
    assert noise_lo < hidden - 32, "hidden size too small for the scripted chain"
    n_noise = hidden - noise_lo
    gen = torch.Generator().manual_seed(seed)
    emb = torch.zeros(padded_vocab, hidden)
    emb[:, 0] = 8.0
    emb[:, noise_lo:] = 0.5 * torch.randn(padded_vocab, n_noise, generator=gen)
    head = torch.zeros(padded_vocab, hidden)
    head[:, noise_lo:] = 0.2 * torch.randn(padded_vocab, n_noise, generator=gen)
    bias = torch.zeros(padded_vocab)
    bias[ids["<|im_end|>"]] = 5.0
    bias[ids["<|im_start|>"]] = -30.0
    bias[ids["<|endoftext|>"]] = -30.0
    bias[n_vocab:] = -60.0                     # padding rows: never sampled
    # Under a JSON grammar almost every token may continue a string; favour the tokens that
    # close strings and objects so that forced tool calls / json_schema answers stay short.
    for tid in range(n_vocab):
        piece = tokenizer.decode([tid])
        if '"' in piece:
            bias[tid] += 4.0
        if "}" in piece:
            bias[tid] += 2.0
    head[:, 0] = bias / 9.9                    # the bias channel is ~9.9 after the final RMSNorm
    for dim, (src, dst) in enumerate(transitions, start=1):
        emb[src, dim] = 8.0
        head[dst, dim] = 4.0                   # ~ +30 logits for the scripted next token
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)

    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)

    # Belt and braces: the chat template also lives in tokenizer_config.json (older readers)
    # and in chat_template.jinja (newer transformers write only this one).
    cfg_path = os.path.join(tmp, "tokenizer_config.json")
    with open(cfg_path) as f:
        tcfg = json.load(f)
    tcfg["chat_template"] = CHAT_TEMPLATE
    tcfg.setdefault("model_max_length", 2048)
    with open(cfg_path, "w") as f:
        json.dump(tcfg, f, indent=2, ensure_ascii=False)
    with open(os.path.join(tmp, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(tmp, "tiny_model_info.json"), "w") as f:
        json.dump({"seed": seed, "vocab": n_vocab, "padded_vocab": padded_vocab, "token_ids": ids,
                   "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
                   "scripted_reasoning": REASONING_TEXT, "scripted_content": CONTENT_TEXT,
                   "scripted_transitions": transitions}, f, indent=2)

    _self_check(tmp)
    _generation_check(tmp, model, tokenizer)

    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    with open(os.path.join(out_dir, ".complete"), "w") as f:
        f.write("ok\n")


def _generation_check(path: str, model, tokenizer) -> None:
    """Greedy-decode one prompt with transformers: the scripted answer must come out."""
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
    expected = f"{REASONING_TEXT}</think>{CONTENT_TEXT}<|im_end|>"
    assert answer == expected, (answer, expected)


def _self_check(path: str) -> None:
    """Reload what was written and render the template the way vLLM will."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "The user wants weather.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    for marker in ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "<think>",
                   "<|im_start|>assistant\n"):
        assert marker in text, (marker, text)
    assert text.endswith("<|im_start|>assistant\n"), text[-80:]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for marker in MARKER_TOKENS + SPECIAL_TOKENS:
        mid = tok.convert_tokens_to_ids(marker)
        assert isinstance(mid, int) and mid >= 0 and tok.decode([mid]) == marker, marker
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert tok.decode(ids) == text


def build_cli(build, what: str, description: str, argv=None) -> int:
    """A builder's command line (the tiny model's, the tiny embedder's): OUT_DIR [--seed N]
    [--force]; a directory already built (its .complete marker) is kept unless --force."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out_dir)
    if not args.force and os.path.exists(os.path.join(out, ".complete")):
        print(f"{what} already built: {out}")
        return 0
    t0 = time.monotonic()
    build(out, seed=args.seed)
    print(f"{what} built in {time.monotonic() - t0:.1f}s: {out}")
    return 0


def main(argv=None) -> int:
    return build_cli(build, "tiny model", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
