"""bik inside other engines: each subpackage plugs bik's kernels into one of them."""
