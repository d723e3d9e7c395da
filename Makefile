# The README's two commands.
.PHONY: test demo
test:
	bash scripts/test.sh
demo:
	bash scripts/demo.sh
