from bootstrap.cli import main

main()
