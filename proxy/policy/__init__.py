"""Request rules shared by a middleware and the translation: the stateless guard, hosted tools,
the image-URL guard."""
