"""No write on reject: ``PagedKVCache`` and the commit of accepted draft K/V into it."""
