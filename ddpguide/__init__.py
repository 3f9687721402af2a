"""ddpguide: the companion package of the book."""
