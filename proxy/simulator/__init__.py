"""The built-in chat-completions server (vLLM/SGLang dialects): the default upstream and the test
suite's. `python -m proxy.simulator.server` runs it alone."""
