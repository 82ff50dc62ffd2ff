"""The nsa-flex command line: a thin shell over the library (installed as nsa_flex_cli)."""
