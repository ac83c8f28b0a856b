"""Integrations of vmmkv into serving engines (optional: each needs its engine installed).

- :mod:`vmmkv.integrations.vllm`: vLLM 0.34.0 (``pip install 'vmmkv[vllm]'``), a
  ``vllm.general_plugins`` entry point enabled with ``VLLM_USE_VMMKV=1``.

Importing this package imports no engine; import a submodule only where its engine is installed.
"""
