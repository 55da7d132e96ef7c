"""The decoding engine: the one loop (`decoder`), `generate`, and the policies it decodes with."""
