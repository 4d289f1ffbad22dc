"""The controller: step states and their table (states.py), the pipeline that decides what
runs next (machine.py), the validation state machine (validation.py) and the asyncio driver
(driver.py). See docs/controller.md."""
