"""Op entry points (``logp``, ``sample``): validation, dispatch, and the native PyTorch reference backends."""
