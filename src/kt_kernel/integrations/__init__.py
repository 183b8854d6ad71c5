"""kt_kernel inside other libraries. Each submodule imports its library when it is imported itself, so
``import kt_kernel`` never needs them: ``kt_kernel.integrations.transformers`` (transformers >= 5)."""
