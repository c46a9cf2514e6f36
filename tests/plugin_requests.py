"""Request bodies exactly as the editor plugins send them, for the server tests.

llama.vim: ``autoload/llama.vim`` (``s:fim`` and ``s:ring_update``), ggml-org/llama.vim.
llama.vscode: ``src/llama-server.ts`` (``createRequestPayload``), ggml-org/llama.vscode.
"""

VIM_RESPONSE_FIELDS = [
    "content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached",
]  # fmt: skip


def llama_vim_fim(prefix, middle, suffix, extra=(), n_predict=128, indent=4, t_max_predict_ms=1000):
    """A FIM completion (the lines above the cursor, the cursor's line up to the cursor, the rest)."""
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": list(extra),
        "prompt": middle,
        "n_predict": n_predict,
        "stop": [],
        "n_indent": indent,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": t_max_predict_ms,
        "response_fields": list(VIM_RESPONSE_FIELDS),
    }


def llama_vim_ring_update(extra):
    """The background request that puts new context chunks in the server's cache."""
    return {
        "id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": list(extra), "prompt": "",
        "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
    }  # fmt: skip


def llama_vscode_fim(prefix, prompt, suffix, chunks=(), nindent=4, n_predict=16):
    """A FIM completion with the extension's defaults (max_parallel_completions 3)."""
    return {
        "id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": list(chunks),
        "prompt": prompt, "n_predict": n_predict, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
        "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": nindent,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 2500,
    }  # fmt: skip


def llama_vscode_prepare(chunks):
    """The extension's "prepare for the next FIM" request (no prediction)."""
    return {
        "id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": list(chunks), "prompt": "",
        "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1,
    }  # fmt: skip
