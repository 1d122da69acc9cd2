"""What the tests share: tiny random models (:mod:`.tiny_models`), independent reference
computations (:mod:`.reference`), running methods and full attention (:mod:`.runs`), sessions on
a disk store (:mod:`.stores`), a compressing spec per method (:mod:`.specs`), and the CLI run
in-process (:mod:`.cli_runner`)."""
