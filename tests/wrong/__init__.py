"""Wrong implementations that every check must reject (one module per topic, each with WRONG)."""
