"""Random request bodies through the ingress's request path (``parse_body`` then ``OpenAIServing.prepare``,
no server): every body is either accepted with engine requests the engine can take, or refused with an
``APIError`` of status 4xx in OpenAI's shape. Never another exception (a 500 for the client). The fields
are the endpoints' own, with values of every JSON type, so the search goes where the validation is."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conflux_cluster.engine.tokenizer import ByteTokenizer
from conflux_cluster.serve.errors import APIError
from conflux_cluster.serve.handlers import OpenAIServing, parse_body
from conflux_cluster.serve.protocol import ChatCompletionRequest, CompletionRequest

VOCAB, CONTEXT = 320, 256
SERVING = OpenAIServing("m", ByteTokenizer(), CONTEXT, backend=None, vocab_size=VOCAB, max_tokens_limit=None)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.sampled_from([0, 1, 2, -1, 0.5, 1.0, 2.0, "", "m", "5", 300, 10**9]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "ignore_eos",
          "presence_penalty", "frequency_penalty", "user", "return_token_ids", "best_of", "logit_bias", "tools"]
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
                                           "content": st.one_of(st.text(max_size=40), values)}), max_size=3)
prompts = st.one_of(st.text(max_size=300), st.lists(st.integers(-5, VOCAB + 5), max_size=40),
                    st.lists(st.text(max_size=20), max_size=3), st.lists(st.lists(st.integers(0, VOCAB), max_size=5),
                                                                         max_size=3), values)
valid = st.fixed_dictionaries(  # what a client means to send: most of these are accepted
    {"model": st.just("m"), "max_tokens": st.integers(1, 40)},
    optional={"prompt": st.one_of(st.text(min_size=1, max_size=300), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                             max_size=300)),
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                          "content": st.text(max_size=80)}), min_size=1, max_size=3),
              "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 400),
              "n": st.integers(1, 3), "seed": st.integers(0, 2**64), "stop": st.lists(st.text(max_size=4), max_size=4),
              "stream": st.booleans(), "ignore_eos": st.booleans(), "logprobs": st.sampled_from([None, 0])})
perturbed = st.one_of(  # ... with one or two fields of any JSON value, or anything at all
    st.builds(lambda b, extra: {**b, **extra}, valid, st.dictionaries(st.sampled_from(FIELDS), values, max_size=2)),
    st.builds(lambda b, p, m: {**b, "prompt": p, "messages": m}, valid, prompts, messages),
    st.fixed_dictionaries({"model": st.sampled_from(["m", "other", 3])},
                          optional={**{f: values for f in FIELDS if f not in ("model", "prompt", "messages")},
                                    "prompt": prompts, "messages": messages}))


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest], ids=["completions", "chat"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=perturbed)
def test_a_random_body_is_accepted_or_a_4xx(cls, body):
    raw = json.dumps(body, allow_nan=False).encode()
    try:
        req = parse_body(raw, cls)
        out = SERVING.prepare(req)
    except APIError as e:
        assert 400 <= e.status < 500, e
        err = e.body()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return
    assert out and all(r.params.max_tokens >= 1 for r in out)
    for r in out:  # what the engine gets fits its context and vocabulary
        assert r.prompt_token_ids and all(0 <= t < VOCAB for t in r.prompt_token_ids)
        assert len(r.prompt_token_ids) + r.params.max_tokens <= CONTEXT
