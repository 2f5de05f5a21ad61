from rlcore.cli.app import main

main()
