"""What kvcli shows a person: the terminal views (:mod:`.terminal`), the one-page HTML report
(:mod:`.html`), what a method kept (:mod:`.inspection`) and the GemFilter layer scan
(:mod:`.layers`). Library functions; the CLI (:mod:`kvcli.cli`) calls them."""
